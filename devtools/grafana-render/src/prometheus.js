// What Grafana 12.4 sends to Prometheus for a panel and what it turns the answer into.
//
// Grafana splits this between its Go backend (pkg/promlib: interval arithmetic, the HTTP call, the
// JSON -> data frame converter) and the frontend (@grafana/prometheus: variable escaping and
// transformV2). The backend part is not on npm, so its few rules are written here, each naming the
// Go function it follows; the frontend part is imported.
import { FieldType, rangeUtil } from '@grafana/data';
import { interpolateQueryExpr, parseSampleValue, transformV2 } from '@grafana/prometheus';

// pkg/promlib/models/query.go: the step is never finer than range / 11000 ("safe resolution").
export const SAFE_RESOLUTION = 11000;

export class QueryError extends Error {}

/** The Prometheus HTTP API, reached through the render server's /prometheus proxy. */
export class Prometheus {
  constructor(base, signalFor) {
    this.base = base.replace(/\/$/, '');
    this.signalFor = signalFor;
  }

  async get(path, params, signal) {
    const query = new URLSearchParams();
    for (const [key, value] of Object.entries(params)) {
      query.append(key, String(value));
    }
    let response;
    try {
      response = await fetch(`${this.base}${path}?${query}`, { signal });
    } catch (err) {
      throw new QueryError(`${path}: ${err.message}`);
    }
    const text = await response.text();
    let body;
    try {
      body = JSON.parse(text);
    } catch {
      throw new QueryError(`${path}: HTTP ${response.status}: ${text.slice(0, 200)}`);
    }
    // pkg/promlib/converter/prom.go ReadPrometheusStyleResult: "errorType: error" is the panel's error.
    if (body.status !== 'success') {
      throw new QueryError(`${body.errorType ?? 'error'}: ${body.error ?? `HTTP ${response.status}`}`);
    }
    return body;
  }
}

/** The intervals Grafana derives for one panel: its $__interval, the query step and $__rate_interval. */
export function panelIntervals(timeRange, maxDataPoints, scrapeInterval) {
  // Frontend (PanelQueryRunner): interval = range / max data points, rounded, never below the scrape interval.
  const { intervalMs } = rangeUtil.calculateInterval(timeRange, maxDataPoints, scrapeInterval);
  const rangeMs = timeRange.to.valueOf() - timeRange.from.valueOf();
  const safeMs = rangeUtil.roundInterval(rangeMs / SAFE_RESOLUTION);
  const scrapeMs = rangeUtil.intervalToMs(scrapeInterval);
  return {
    intervalMs,
    // calculatePrometheusInterval: max(calculated, safe).
    stepMs: Math.max(intervalMs, safeMs),
    // calculateRateInterval: max($__interval + scrape interval, 4 x scrape interval).
    rateIntervalMs: Math.max(intervalMs + scrapeMs, 4 * scrapeMs),
    rangeMs,
  };
}

/** Dashboard variables as Grafana's template service substitutes them into a Prometheus query. */
export function interpolateVariables(expr, variables) {
  // Longest name first, so $target never eats the start of $target_group.
  const names = Object.keys(variables).sort((a, b) => b.length - a.length);
  for (const name of names) {
    const { value, model, customAll } = variables[name];
    // A custom "All" value goes in as written, unescaped (scenes' CustomAllValue, TemplateSrv before it).
    const replacement = customAll ? value : interpolateQueryExpr(value, model);
    expr = expr
      .split(`\${${name}}`).join(replacement)
      .replace(new RegExp(`\\$${name}(?![A-Za-z0-9_])`, 'g'), () => replacement);
  }
  return expr;
}

/** pkg/promlib/models/query.go interpolateVariables: the built-in interval and range variables. */
export function interpolateBuiltins(expr, intervals) {
  const rangeS = Math.round(intervals.rangeMs / 1000);
  const pairs = [
    ['__rate_interval_ms', String(intervals.rateIntervalMs)],
    ['__rate_interval', goDuration(intervals.rateIntervalMs)],
    ['__interval_ms', String(intervals.stepMs)],
    ['__interval', rangeUtil.secondsToHms(intervals.stepMs / 1000)],
    ['__range_ms', String(intervals.rangeMs)],
    ['__range_s', String(rangeS)],
    ['__range', `${rangeS}s`],
  ];
  for (const [name, value] of pairs) {
    expr = expr.split(`\${${name}}`).join(value).split(`$${name}`).join(value);
  }
  return expr;
}

/** Go's time.Duration.String(), which the backend writes into the query (e.g. 1m0s). */
export function goDuration(ms) {
  if (ms === 0) {
    return '0s';
  }
  const hours = Math.floor(ms / 3600000);
  const minutes = Math.floor((ms % 3600000) / 60000);
  const seconds = (ms % 60000) / 1000;
  if (!hours && !minutes) {
    return ms < 1000 ? `${ms}ms` : `${seconds}s`;
  }
  return `${hours ? `${hours}h` : ''}${minutes}m${seconds}s`;
}

/** pkg/promlib/models/query.go AlignTimeRange: start and end rounded down to a multiple of the step. */
export function alignToStep(ms, stepMs) {
  return Math.floor(ms / stepMs) * stepMs;
}

/** pkg/promlib/querydata/response.go getName: the series' display name from the legend format. */
function legendName(legendFormat, labels, expr) {
  const entries = Object.entries(labels).filter(([key]) => key !== '__name__');
  let legend;
  if (legendFormat === '__auto') {
    legend = entries.length || labels.__name__ ? '' : '{}';
  } else if (legendFormat) {
    legend = legendFormat.replace(/\{\{\s*(.+?)\s*\}\}/g, (_, name) => labels[name] ?? '');
  } else {
    const inner = entries.sort(([a], [b]) => (a < b ? -1 : 1)).map(([k, v]) => `${k}=${JSON.stringify(v)}`);
    legend = inner.length ? `${labels.__name__ ?? ''}{${inner.join(', ')}}` : (labels.__name__ ?? '{}');
  }
  return legend === '{}' ? expr : legend;
}

/**
 * pkg/promlib/converter/prom.go readMatrixOrVectorMulti (dataplane, the only mode in 12.4) plus
 * querydata/response.go addMetadataToMultiFrame: one frame per series, Time and Value fields, the
 * labels on the value field, the legend as displayNameFromDS, the step as the time field's interval.
 */
export function framesFromAnswer(body, target, expr, stepMs) {
  const { resultType, result } = body.data;
  if (!['matrix', 'vector', 'scalar'].includes(resultType)) {
    throw new QueryError(`unknown result type: ${resultType}`);
  }
  const series = resultType === 'scalar' ? [{ metric: {}, value: result }] : result;
  const frames = series.map((one) => {
    const pairs = one.values ?? [one.value];
    const labels = { ...one.metric };
    const name = legendName(target.legendFormat, labels, expr);
    return {
      refId: target.refId,
      meta: {
        type: resultType === 'matrix' ? 'timeseries-multi' : 'numeric-multi',
        typeVersion: [0, 1],
        custom: { resultType },
      },
      fields: [
        { name: 'Time', type: FieldType.time, config: { interval: stepMs }, values: pairs.map(([t]) => Math.round(t * 1000)) },
        {
          name: labels.__name__ ?? 'Value',
          type: FieldType.number,
          labels,
          config: name ? { displayNameFromDS: name } : {},
          values: pairs.map(([, v]) => parseSampleValue(v)),
        },
      ],
      length: pairs.length,
    };
  });
  // parseResponse: an empty answer is still one frame, carrying the query's metadata.
  if (frames.length === 0) {
    frames.push({ refId: target.refId, meta: { executedQueryString: `Expr: ${expr}` }, fields: [], length: 0 });
  }
  return frames;
}

/**
 * Runs every query of a panel as Grafana does: instant where the target asks for it, a step-aligned
 * range query otherwise; the frames then go through @grafana/prometheus' transformV2 (result_transformer.ts),
 * which Grafana's frontend applies to the backend's answer (format table -> one table per query with
 * "Value #refId" columns, format heatmap -> de-cumulated buckets).
 */
export async function runPanelQueries({ panel, prometheus, variables, timeRange, intervals, signal }) {
  const queries = [];
  const frames = [];
  for (const target of panel.targets ?? []) {
    if (target.hide) {
      continue;
    }
    const expr = interpolateBuiltins(interpolateVariables(target.expr, variables), intervals);
    const instant = Boolean(target.instant) && !target.range;
    const to = timeRange.to.valueOf();
    // The parameters go into displayed.json as sent: a check can ask Prometheus the very same question.
    const params = instant ? { query: expr, time: to / 1000 } : {
      query: expr,
      start: alignToStep(timeRange.from.valueOf(), intervals.stepMs) / 1000,
      end: alignToStep(to, intervals.stepMs) / 1000,
      step: intervals.stepMs / 1000,
    };
    const body = await prometheus.get(instant ? '/api/v1/query' : '/api/v1/query_range', params, signal);
    queries.push({ refId: target.refId, instant, ...params });
    frames.push(...framesFromAnswer(body, target, expr, intervals.stepMs));
  }
  const response = transformV2({ data: frames }, { targets: panel.targets ?? [], app: 'dashboard' }, {});
  return { queries, frames: response.data };
}

/** label_values(selector, label) as the Prometheus variable support runs it: the labels API with match[]. */
export async function labelValues(prometheus, query, variables, timeRange, signal) {
  const match = /^label_values\((?:(.*),\s*)?(\w+)\)$/.exec(query.trim());
  if (!match) {
    throw new QueryError(`unsupported variable query ${query}`);
  }
  const [, selector, label] = match;
  const params = { start: Math.floor(timeRange.from.valueOf() / 1000), end: Math.floor(timeRange.to.valueOf() / 1000) };
  if (selector) {
    params['match[]'] = interpolateVariables(selector, variables);
  }
  const body = await prometheus.get(`/api/v1/label/${label}/values`, params, signal);
  return body.data;
}
