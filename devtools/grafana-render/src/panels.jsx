// The panels' visualisations, each as Grafana 12.4's panel plugin renders it from @grafana/ui.
// Grafana's panel plugins live in its core app (public/app/plugins/panel/*), not on npm: the
// components below make the same calls as StatPanel.tsx, table-new/TablePanel.tsx and
// TimeSeriesPanel.tsx. State timeline and heatmap have no @grafana/ui component; they are drawn
// here from the values and colours Grafana's display processor gives (marked as such in displayed.json).
import React from 'react';
import { FALLBACK_COLOR, FieldColorModeId, FieldType, MappingType, SpecialValueMatch, ThresholdsMode, applyNullInsertThreshold,
  cacheFieldDisplayNames, formattedValueToString, getActiveThreshold, getDisplayProcessor, getDisplayValueAlignmentFactors,
  getFieldConfigWithMinMax, getFieldDisplayName, getFieldDisplayValues, getValueFormat, nullToValue } from '@grafana/data';
import { BigValue, TimeSeries, VizLayout, VizLegend, VizRepeater, useTheme2 } from '@grafana/ui';
import { TableNG } from '@grafana/ui/unstable';
import { interpolateOranges } from 'd3-scale-chromatic';

const NO_DATA = 'No data';

/** public/app/plugins/panel/stat/panelcfg.gen.ts defaultOptions (and the common reduce options). */
const STAT_DEFAULTS = {
  colorMode: 'value', graphMode: 'area', justifyMode: 'auto', textMode: 'auto', wideLayout: true,
  showPercentChange: false, percentChangeColorMode: 'standard', orientation: 'auto',
  reduceOptions: { calcs: ['lastNotNull'], values: false, fields: '' },
};

export function NoData({ width, height, fieldConfig }) {
  // @grafana/runtime's PanelDataErrorView with no error: the centred message, the panel's noValue where it has one
  // (getMessageFor), else "No data".
  const theme = useTheme2();
  return (
    <div data-no-data="" style={{ width, height, display: 'flex', alignItems: 'center', justifyContent: 'center',
      color: theme.colors.text.primary }}>
      {fieldConfig?.defaults?.noValue || NO_DATA}
    </div>
  );
}

export function StatViz({ panel, series, fieldConfig, width, height, theme, timeRange, record }) {
  const options = { ...STAT_DEFAULTS, ...panel.options, reduceOptions: { ...STAT_DEFAULTS.reduceOptions, ...panel.options?.reduceOptions } };
  // StatPanel.getTextMode: a panel without a title, or a fixed display name, always shows the name.
  const textMode = options.textMode === 'auto' && (fieldConfig.defaults.displayName || !panel.title) ? 'value_and_name' : options.textMode;
  const getValues = () => {
    const values = getFieldDisplayValues({
      fieldConfig, reduceOptions: options.reduceOptions, replaceVariables: (s) => s, theme, data: series,
      sparkline: options.graphMode !== 'none', percentChange: options.showPercentChange, timeZone: 'browser',
    });
    record.values = values.map((value) => ({
      name: value.display.title ?? value.name,
      text: formattedValueToString(value.display),
      numeric: Number.isFinite(value.display.numeric) ? value.display.numeric : null,
      color: value.display.color,
    }));
    return values;
  };
  return (
    <VizRepeater
      getValues={getValues}
      getAlignmentFactors={getDisplayValueAlignmentFactors}
      renderValue={({ value, alignmentFactors, width: w, height: h, count }) => {
        const sparkline = value.sparkline ? { ...value.sparkline, timeRange } : undefined;
        return (
          <BigValue value={value.display} count={count} sparkline={sparkline} colorMode={options.colorMode}
            graphMode={options.graphMode} justifyMode={options.justifyMode} textMode={textMode}
            alignmentFactors={alignmentFactors} text={options.text} width={w} height={h} theme={theme}
            disableWideLayout={!options.wideLayout} percentChangeColorMode={options.percentChangeColorMode} />
        );
      }}
      width={width} height={height} source={series} itemSpacing={3} renderCounter={0} autoGrid={true}
      orientation={options.orientation}
    />
  );
}

export function TableViz({ panel, series, fieldConfig, width, height, timeRange, record }) {
  const options = { showHeader: true, cellHeight: 'sm', ...panel.options };
  cacheFieldDisplayNames(series);
  const main = series[options.frameIndex > 0 && options.frameIndex < series.length ? options.frameIndex : 0];
  if (!main || !series.some((frame) => frame.fields.length > 0)) {
    record.noData = true;
    return <NoData width={width} height={height} fieldConfig={fieldConfig} />;
  }
  return (
    <TableNG height={height} width={width} data={main} noHeader={!options.showHeader} showTypeIcons={options.showTypeIcons}
      resizable={true} initialSortBy={options.sortBy} footerOptions={options.footer}
      enablePagination={options.footer?.enablePagination} cellHeight={options.cellHeight} timeRange={timeRange}
      fieldConfig={fieldConfig} structureRev={1} enableVirtualization={false} />
  );
}

/** public/app/plugins/panel/timeseries/utils.ts prepareGraphableFields, for time and number fields. */
export function prepareGraphableFields(series, theme, timeRange) {
  if (!series?.length) {
    return null;
  }
  cacheFieldDisplayNames(series);
  const frames = [];
  for (const frame of series) {
    const nulled = applyNullInsertThreshold({ frame, refFieldPseudoMin: timeRange.from.valueOf(), refFieldPseudoMax: timeRange.to.valueOf() });
    const fields = [];
    let hasTime = false;
    let hasValue = false;
    for (const field of nullToValue(nulled).fields) {
      if (field.type === FieldType.time) {
        hasTime = true;
        fields.push(field);
      } else if (field.type === FieldType.number) {
        hasValue = true;
        fields.push({ ...field, values: field.values.map((v) => (Number.isFinite(v) || v == null ? v : null)) });
      }
    }
    if (hasTime && hasValue) {
      frames.push({ ...frame, length: nulled.length, fields });
    }
  }
  if (!frames.length) {
    return null;
  }
  // setClassicPaletteIdxs: series colours follow one index across all frames.
  let seriesIndex = 0;
  for (const frame of frames) {
    for (const field of frame.fields) {
      if (field.type === FieldType.number) {
        field.state = { ...field.state, seriesIndex: seriesIndex++ };
        field.display = getDisplayProcessor({ field, theme });
      }
    }
  }
  return frames;
}

export function TimeSeriesViz({ panel, series, fieldConfig, width, height, theme, timeRange, record }) {
  const frames = prepareGraphableFields(series, theme, timeRange);
  if (!frames) {
    record.noData = true;
    return <NoData width={width} height={height} fieldConfig={fieldConfig} />;
  }
  const legend = { showLegend: true, displayMode: 'list', placement: 'bottom', calcs: [], ...panel.options?.legend };
  return (
    <TimeSeries frames={frames} structureRev={1} timeRange={timeRange} timeZone="browser" width={width} height={height}
      legend={legend} options={panel.options} theme={theme} />
  );
}

/**
 * TimelineChart/utils.ts getThresholdItems: each threshold step as a legend item, "< next" for the base step
 * (when another follows), "value+" for the others, in the field's unit (percent in percentage mode).
 */
function thresholdItems(config, theme) {
  const steps = config.thresholds?.steps ?? [];
  const format = getValueFormat(config.thresholds?.mode === ThresholdsMode.Percentage ? 'percent' : (config.unit ?? ''));
  const text = (value) => formattedValueToString(format(value, config.decimals ?? undefined));
  return steps.map((step, i) => {
    const base = step.value === -Infinity && i < steps.length - 1;
    return { label: base ? `< ${text(steps[i + 1].value)}` : `${text(step.value)}+`,
      color: theme.visualization.getColorByName(step.color), yAxis: 1, step };
  });
}

/**
 * TimelineChart/utils.ts prepareTimelineFields on a number field with mergeValues on and colours from thresholds
 * (mergeThresholdValues): each value becomes the label of its threshold step, in that step's colour. The field's
 * value mappings are not applied there (Grafana's issues 41075 and 71804): a dashboard that names its states by
 * mappings colours them by a fixed scheme instead.
 */
function mergedByThreshold(field, theme) {
  const steps = field.config.thresholds?.steps ?? [];
  if (!(field.config.color?.mode === FieldColorModeId.Thresholds && steps.length)) {
    return field;
  }
  const items = thresholdItems(field.config, theme);
  const labelOf = new Map(items.map((item) => [item.step, item.label]));
  const colourOf = new Map(items.map((item) => [item.label, item.color]));
  let input = field.values;
  if (field.config.thresholds.mode === ThresholdsMode.Percentage) {
    const { min, max } = getFieldConfigWithMinMax(field);
    input = input.map((v) => (v == null ? v : ((v - min) / (max - min)) * 100));
  }
  return {
    ...field, type: FieldType.string,
    values: input.map((v) => (v == null ? v : labelOf.get(getActiveThreshold(v, steps)))),
    display: (value) => ({ text: String(value), color: colourOf.get(String(value)), numeric: NaN }),
  };
}

/** Whether a field's value mappings name a missing value (TimelineChart draws it as a state then, not a gap). */
function mapsNull(field) {
  return (field.config.mappings ?? []).some((m) => m.type === MappingType.SpecialValue
    && [SpecialValueMatch.Null, SpecialValueMatch.NullAndNaN].includes(m.options.match));
}

/**
 * TimelineChart/utils.ts prepareTimelineLegendItems (getFieldLegendItem): with colours from more than one threshold
 * step, the steps; with a continuous scheme, none; otherwise every state the lanes' values display (each value
 * through the field's display processor), once per text, in the order the values first show it, in the colour it
 * last showed.
 */
function timelineLegendItems(frames, legend, theme) {
  const fields = frames.flatMap((frame) => frame.fields.filter((f) => f.type !== FieldType.time));
  if (legend.showLegend === false || !fields.length) {
    return undefined;
  }
  const config = fields[0].config;
  const mode = config.color?.mode ?? FieldColorModeId.Fixed;
  if (mode === FieldColorModeId.Thresholds && (config.thresholds?.steps?.length ?? 0) > 1) {
    return thresholdItems(config, theme).map(({ step, ...item }) => item);
  }
  if (mode.startsWith('continuous')) {
    return undefined;
  }
  const colours = new Map();
  for (const field of fields.filter((f) => !f.config.custom?.hideFrom?.legend)) {
    for (const value of field.values) {
      const shown = field.display(value);
      if (shown.color) {
        colours.set(shown.text, shown.color);
      }
    }
  }
  return [...colours].filter(([label]) => label.length > 0)
    .map(([label, color]) => ({ label, color: theme.visualization.getColorByName(color), yAxis: 1 }));
}

/**
 * A state timeline's lanes: one per series, each a run of segments of equal value (mergeValues), a
 * segment ending where the next value starts or a null (Grafana's inserted gap) stops it; a null the
 * field's mappings name is a segment of its own.
 */
function timelineLanes(frames, mergeValues) {
  const lanes = [];
  for (const frame of frames) {
    const time = frame.fields.find((f) => f.type === FieldType.time);
    for (const field of frame.fields.filter((f) => f.type !== FieldType.time)) {
      const drawsNull = mapsNull(field);
      const segments = [];
      field.values.forEach((value, i) => {
        const last = segments[segments.length - 1];
        if (last && last.end === null) {
          last.end = time.values[i];
        }
        if (value == null && !drawsNull) {
          return;
        }
        if (mergeValues && last && last.value === value && last.end === time.values[i]) {
          last.end = null;
        } else {
          segments.push({ value, start: time.values[i], end: null });
        }
      });
      lanes.push({ name: getFieldDisplayName(field, frame, frames), field, segments });
    }
  }
  return lanes;
}

function TimelineLanes({ lanes, panel, width, height, theme, timeRange }) {
  const from = timeRange.from.valueOf();
  const to = timeRange.to.valueOf();
  const labelWidth = Math.min(160, Math.floor(width / 4));
  const laneHeight = Math.max(8, Math.floor((height - 20) / lanes.length));
  const x = (t) => labelWidth + ((Math.min(t, to) - from) / (to - from)) * (width - labelWidth - 4);
  const opacity = (panel.fieldConfig?.defaults?.custom?.fillOpacity ?? 70) / 100;
  return (
    <svg width={width} height={height}>
      {lanes.map((lane, row) => {
        const y = row * laneHeight;
        return (
          <g key={lane.name}>
            <text x={labelWidth - 6} y={y + laneHeight / 2 + 4} fill={theme.colors.text.primary} fontSize="12" textAnchor="end">{lane.name}</text>
            {lane.segments.map((segment) => (
              <rect key={segment.start} x={x(segment.start)} y={y + 1}
                width={Math.max(1, x(segment.end ?? to) - x(segment.start))}
                height={laneHeight * (panel.options?.rowHeight ?? 0.9)}
                fill={lane.field.display(segment.value).color ?? FALLBACK_COLOR}
                fillOpacity={opacity} />
            ))}
          </g>
        );
      })}
    </svg>
  );
}

export function StateTimelineViz({ panel, series, fieldConfig, width, height, theme, timeRange, record }) {
  const mergeValues = panel.options?.mergeValues ?? true;
  const graphable = prepareGraphableFields(series, theme, timeRange);
  const frames = graphable && graphable.map((frame) => (mergeValues
    ? { ...frame, fields: frame.fields.map((f) => (f.type === FieldType.number ? mergedByThreshold(f, theme) : f)) }
    : frame));
  const lanes = frames ? timelineLanes(frames, mergeValues).filter((l) => l.segments.some((s) => s.value != null)) : [];
  if (!lanes.length) {
    record.noData = true;
    return <NoData width={width} height={height} fieldConfig={fieldConfig} />;
  }
  record.drawnBy = 'renderer lanes: colours and texts from @grafana/data display processor (no @grafana/ui state timeline)';
  record.lanes = lanes.map((lane) => {
    const shown = lane.field.display(lane.segments.filter((s) => s.value != null).pop().value);
    return { name: lane.name, last: formattedValueToString(shown), color: shown.color };
  });
  // TimelineChart's legend: VizLegend below (or beside) the lanes, in the panel's legend options.
  const options = { showLegend: true, displayMode: 'list', placement: 'bottom', ...panel.options?.legend };
  const items = timelineLegendItems(frames, options, theme);
  const legend = items ? (
    <VizLayout.Legend placement={options.placement}>
      <VizLegend placement={options.placement} items={items} displayMode={options.displayMode} readonly />
    </VizLayout.Legend>
  ) : null;
  return (
    <VizLayout width={width} height={height} legend={legend}>
      {(w, h) => <TimelineLanes lanes={lanes} panel={panel} width={w} height={h} theme={theme} timeRange={timeRange} />}
    </VizLayout>
  );
}

/**
 * public/app/plugins/panel/heatmap/palettes.ts quantizeScheme: the scheme's interpolator in `steps`
 * colours, reversed on a dark theme for the schemes marked invert: 'dark' (Oranges among them).
 */
function heatmapPalette(options, theme) {
  const steps = options?.steps ?? 64;
  const palette = Array.from({ length: steps }, (_, i) => interpolateOranges(i / (steps - 1)));
  return theme.isDark !== Boolean(options?.reverse) ? palette.reverse() : palette;
}

export function HeatmapViz({ panel, series, fieldConfig, width, height, theme, timeRange, record }) {
  // transformV2 turned format=heatmap into one HeatmapRows frame: time, then one count field per bucket.
  const frame = series.find((f) => f.fields.length > 1 && f.fields.some((fl) => fl.type === FieldType.time));
  const buckets = frame ? frame.fields.filter((f) => f.type === FieldType.number) : [];
  const time = frame?.fields.find((f) => f.type === FieldType.time);
  const max = Math.max(0, ...buckets.flatMap((b) => b.values.filter(Number.isFinite)));
  if (!buckets.length || max === 0) {
    record.noData = true;
    return <NoData width={width} height={height} fieldConfig={fieldConfig} />;
  }
  record.drawnBy = 'renderer cells: buckets from @grafana/prometheus transformV2, colours as the heatmap panel quantizes its scheme (no @grafana/ui heatmap)';
  const palette = heatmapPalette(panel.options?.color, theme);
  const exponent = panel.options?.color?.exponent ?? 0.5;
  const format = getValueFormat(panel.options?.yAxis?.unit ?? 'short');
  const bound = (b) => {
    const le = Number(getFieldDisplayName(b, frame, series));
    return Number.isFinite(le) ? formattedValueToString(format(le)) : getFieldDisplayName(b, frame, series);
  };
  record.buckets = buckets.map(bound);
  const labelWidth = 72;
  const from = timeRange.from.valueOf();
  const span = timeRange.to.valueOf() - from;
  const rowHeight = (height - 4) / buckets.length;
  const labelEvery = Math.ceil(14 / rowHeight);
  const cellWidth = Math.max(1, ((width - labelWidth) * (time.config.interval ?? 15000)) / span);
  const gap = panel.options?.cellGap ?? 1;
  return (
    <svg width={width} height={height}>
      {buckets.map((bucket, row) => {
        const y = height - (row + 1) * rowHeight;
        return (
          <g key={row}>
            {row % labelEvery === 0 ? (
              <text x={labelWidth - 4} y={y + rowHeight / 2 + 4} fill={theme.colors.text.primary} fontSize="11" textAnchor="end">{bound(bucket)}</text>
            ) : null}
            {bucket.values.map((count, i) => (count > 0 ? (
              <rect key={i} x={labelWidth + ((time.values[i] - from) / span) * (width - labelWidth) - cellWidth}
                y={y} width={Math.max(1, cellWidth - gap)} height={Math.max(1, rowHeight - gap)}
                fill={palette[Math.min(palette.length - 1, Math.floor((count / max) ** exponent * palette.length))]} />
            ) : null))}
          </g>
        );
      })}
    </svg>
  );
}

export const VISUALISATIONS = {
  stat: StatViz,
  table: TableViz,
  timeseries: TimeSeriesViz,
  'state-timeline': StateTimelineViz,
  heatmap: HeatmapViz,
};
