// The dashboard's Prometheus annotations (firing alerts from ALERTS), queried and drawn on the time series they
// concern, as Grafana 12.4 does: @grafana/prometheus' annotation support sends each one as a range query whose
// minimum step is the annotation's `step` (60s unless set), and turns each series' samples above 0 into regions,
// one per run of samples no more than a step apart (annotations.ts); the dashboard draws them on the panels the
// annotation's filter names (every panel without one) as translucent regions of its colour over the plot.
import { rangeUtil } from '@grafana/data';

import { SAFE_RESOLUTION, alignToStep, interpolateVariables } from './prometheus';

const DEFAULT_STEP = '60s'; // @grafana/prometheus ANNOTATION_QUERY_STEP_DEFAULT

/** renderLegendFormat: {{label}} replaced by the series' label values. */
function format(template, labels) {
  return (template ?? '').replace(/\{\{\s*(.+?)\s*\}\}/g, (_, name) => labels[name] ?? '');
}

/** Every enabled annotation's events over the time range: {annotation, panels (ids or null), exclude, title, text,
 * tags, time, timeEnd} (epoch ms). */
export async function annotationEvents(dashboard, prometheus, variables, timeRange) {
  const events = [];
  const from = timeRange.from.valueOf();
  const to = timeRange.to.valueOf();
  for (const annotation of dashboard.annotations?.list ?? []) {
    const expr = annotation.target?.expr ?? annotation.expr;
    if (!annotation.enable || !expr) {
      continue;
    }
    const stepMs = Math.max(rangeUtil.intervalToMs(annotation.step || DEFAULT_STEP),
      rangeUtil.roundInterval((to - from) / SAFE_RESOLUTION));
    const body = await prometheus.get('/api/v1/query_range', {
      query: interpolateVariables(expr, variables), start: alignToStep(from, stepMs) / 1000,
      end: alignToStep(to, stepMs) / 1000, step: stepMs / 1000,
    });
    for (const series of body.data.result) {
      const labels = series.metric;
      const tags = (annotation.tagKeys ?? '').split(',').map((key) => labels[key.trim()]).filter(Boolean);
      let open = null;
      for (const [t, value] of series.values) {
        const time = Math.round(t * 1000);
        if (!(Number(value) > 0)) {
          continue;
        }
        if (open && open.timeEnd + stepMs >= time) {
          open.timeEnd = time;
          continue;
        }
        open = { annotation: annotation.name, panels: annotation.filter?.ids ?? null,
          exclude: Boolean(annotation.filter?.exclude), color: annotation.iconColor ?? 'red',
          title: format(annotation.titleFormat, labels), text: format(annotation.textFormat, labels), tags,
          time, timeEnd: time };
        events.push(open);
      }
    }
  }
  return events;
}

function appliesTo(event, panelId) {
  return event.panels === null || event.panels.includes(panelId) !== event.exclude;
}

/** Each time series panel's events drawn over its plot (uPlot's .u-over, which spans the time range) and listed in
 * its record: {annotation, title, text, tags, time, timeEnd}. */
export function drawAnnotations(displayed, events, timeRange, theme) {
  const from = timeRange.from.valueOf();
  const to = timeRange.to.valueOf();
  for (const record of displayed.panels) {
    if (record.type !== 'timeseries') {
      continue;
    }
    const over = document.querySelector(`[data-panel-id="${record.id}"] .u-over`);
    const shown = events.filter((event) => appliesTo(event, record.id) && event.timeEnd >= from && event.time <= to);
    record.annotations = shown.map(({ annotation, title, text, tags, time, timeEnd }) => (
      { annotation, title, text, tags, time, timeEnd }));
    if (!over) {
      continue;
    }
    const width = over.clientWidth;
    for (const event of shown) {
      const left = Math.max(0, ((event.time - from) / (to - from)) * width);
      const right = Math.min(width, ((event.timeEnd - from) / (to - from)) * width);
      const colour = theme.visualization.getColorByName(event.color);
      const region = document.createElement('div');
      region.setAttribute('data-annotation', event.title);
      Object.assign(region.style, {
        position: 'absolute', top: '0', bottom: '0', left: `${left}px`, width: `${Math.max(1, right - left)}px`,
        background: `${colour}26`, borderLeft: `1px dashed ${colour}`, pointerEvents: 'none',
      });
      over.appendChild(region);
    }
  }
}
