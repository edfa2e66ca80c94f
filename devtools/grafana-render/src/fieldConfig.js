// A panel's field config as Grafana 12.4 holds it once the panel's plugin is loaded: the plugin's
// defaults under the saved JSON, null threshold bases as -Infinity, and the option registry that
// applyFieldOverrides needs to apply defaults and overrides. Grafana builds these in its core app
// (public/app/features/dashboard/state/getPanelOptionsWithDefaults.ts, the panels' module.tsx and
// core/components/OptionsUI/registry.tsx), which is not on npm; the defaults below are theirs.
import {
  FieldColorModeId,
  FieldConfigOptionsRegistry,
  dataLinksOverrideProcessor,
  displayNameOverrideProcessor,
  identityOverrideProcessor,
  numberOverrideProcessor,
  stringOverrideProcessor,
  thresholdsOverrideProcessor,
  valueMappingsOverrideProcessor,
} from '@grafana/data';
import { defaultTableFieldOptions } from '@grafana/schema';

// public/app/plugins/panel/timeseries/config.ts defaultGraphConfig and the builder's other defaults.
const GRAPH_CUSTOM = {
  drawStyle: 'line',
  lineInterpolation: 'linear',
  lineWidth: 1,
  fillOpacity: 0,
  gradientMode: 'none',
  barAlignment: 0,
  barWidthFactor: 0.6,
  stacking: { mode: 'none', group: 'A' },
  axisGridShow: true,
  axisCenteredZero: false,
  axisBorderShow: false,
  axisPlacement: 'auto',
  axisLabel: '',
  axisColorMode: 'text',
  scaleDistribution: { type: 'linear' },
  spanNulls: false,
  insertNulls: false,
  showPoints: 'auto',
  pointSize: 5,
  hideFrom: { tooltip: false, viz: false, legend: false },
  thresholdsStyle: { mode: 'off' },
};

// Per panel type: the standard options' defaults that differ from Grafana's (color) and the custom ones.
const PLUGIN_DEFAULTS = {
  timeseries: { color: { mode: FieldColorModeId.PaletteClassic }, custom: GRAPH_CUSTOM },
  // public/app/plugins/panel/state-timeline/module.tsx
  'state-timeline': {
    color: { mode: FieldColorModeId.ContinuousGrYlRd },
    custom: { lineWidth: 0, fillOpacity: 70, hideFrom: { tooltip: false, viz: false, legend: false } },
  },
  table: { custom: { ...defaultTableFieldOptions, cellOptions: { type: 'auto' }, inspect: false } },
  stat: {},
  heatmap: { custom: { hideFrom: { tooltip: false, viz: false, legend: false }, scaleDistribution: { type: 'linear' } } },
};

const STANDARD_OPTIONS = [
  ['unit', stringOverrideProcessor],
  ['decimals', numberOverrideProcessor],
  ['min', numberOverrideProcessor],
  ['max', numberOverrideProcessor],
  ['displayName', displayNameOverrideProcessor],
  ['noValue', stringOverrideProcessor],
  ['color', identityOverrideProcessor],
  ['thresholds', thresholdsOverrideProcessor],
  ['mappings', valueMappingsOverrideProcessor],
  ['links', dataLinksOverrideProcessor],
  ['filterable', identityOverrideProcessor],
];

export const SUPPORTED_PANELS = Object.keys(PLUGIN_DEFAULTS);

/** getPanelOptionsWithDefaults' fixThresholds: JSON cannot hold -Infinity, so a saved base step is null. */
function fixThresholds(thresholds) {
  if (thresholds?.steps?.length) {
    thresholds.steps[0].value = -Infinity;
  }
}

function deepMerge(base, over) {
  if (over === undefined) {
    return structuredClone(base);
  }
  if (typeof base !== 'object' || base === null || Array.isArray(base) || typeof over !== 'object' || over === null) {
    return structuredClone(over);
  }
  const out = structuredClone(base);
  for (const [key, value] of Object.entries(over)) {
    out[key] = deepMerge(base[key], value);
  }
  return out;
}

/** The panel's field config with its plugin's defaults filled in, as the loaded dashboard has it. */
export function effectiveFieldConfig(panel) {
  const fieldConfig = deepMerge({ defaults: PLUGIN_DEFAULTS[panel.type] ?? {}, overrides: [] }, panel.fieldConfig ?? {});
  fixThresholds(fieldConfig.defaults.thresholds);
  for (const override of fieldConfig.overrides) {
    for (const property of override.properties) {
      if (property.id === 'thresholds') {
        fixThresholds(property.value);
      }
    }
  }
  return fieldConfig;
}

/** The options registry for one panel: the standard options plus every custom.* it uses. */
export function fieldConfigRegistry(fieldConfig) {
  const customPaths = new Set(Object.keys(fieldConfig.defaults.custom ?? {}));
  for (const override of fieldConfig.overrides) {
    for (const property of override.properties) {
      if (property.id.startsWith('custom.')) {
        customPaths.add(property.id.slice('custom.'.length));
      }
    }
  }
  const item = (id, path, process, isCustom) => ({
    id,
    path,
    name: id,
    process,
    isCustom,
    override: () => null,
    editor: () => null,
    shouldApply: () => true,
  });
  return new FieldConfigOptionsRegistry(() => [
    ...STANDARD_OPTIONS.map(([id, process]) => item(id, id, process, false)),
    ...[...customPaths].map((path) => item(`custom.${path}`, path, identityOverrideProcessor, true)),
  ]);
}
