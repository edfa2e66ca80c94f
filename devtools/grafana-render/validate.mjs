// Checks dashboard JSON against Grafana 12.4's own dashboard model.
//
//   node validate.mjs DASHBOARD.json...
//
// @grafana/schema ships the model as TypeScript types (generated from Grafana's CUE schema), not as a
// JSON schema, so the check is the TypeScript compiler's: each dashboard is written into a virtual .ts
// file as object literals checked with `satisfies` (which keeps literal types and rejects unknown keys):
// the whole dashboard as `Dashboard`, each panel's options and custom field config as its panel
// plugin's `Options` and `FieldConfig` (the plugins' panelcfg types), each query as @grafana/prometheus'
// `Prometheus` query. A type error is reported with the panel it is in. Exit 0 when all pass, 1 when
// one does not, 2 when a file cannot be read as JSON.
import { readFileSync } from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import ts from 'typescript';

const HERE = path.dirname(fileURLToPath(import.meta.url));
const PANELCFG = '@grafana/schema/dist/esm/raw/composable';
// Panel type -> its panelcfg module and whether it declares a custom FieldConfig.
const PANEL_TYPES = {
  stat: ['stat/panelcfg/x/StatPanelCfg_types.gen', false],
  table: ['table/panelcfg/x/TablePanelCfg_types.gen', true],
  timeseries: ['timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen', true],
  'state-timeline': ['statetimeline/panelcfg/x/StateTimelinePanelCfg_types.gen', true],
  heatmap: ['heatmap/panelcfg/x/HeatmapPanelCfg_types.gen', true],
};

// The types the JSON is checked against. Json<T> is T as JSON can write it: a string enum is its
// values (JSON has "absolute", not ThresholdsMode.Absolute). A saved panel leaves out options its
// plugin defaults (Grafana fills them in on load), hence Partial at the top of Options and FieldConfig.
// SavedVariable and PrometheusAnnotation add the keys Grafana saves and reads that @grafana/schema's v1
// types leave out: a query variable's "definition" (its editor text), the interval variable's auto
// fields (Grafana's JSON model documents them; the foundation SDK writes them on every variable), and
// the Prometheus annotation's title, text and tag settings (read by @grafana/prometheus annotations.ts).
const PRELUDE = [
  "import type { AnnotationQuery, Dashboard, VariableModel } from '@grafana/schema';",
  "import type { Prometheus } from '@grafana/prometheus';",
  ...Object.values(PANEL_TYPES).map(([module], index) => `import type * as p${index} from '${PANELCFG}/${module}';`),
  'type Json<T> = T extends string ? (string extends T ? string : `${T}`)',
  '  : T extends number | boolean | null | undefined ? T',
  '  : T extends Array<infer U> ? Array<Json<U>>',
  '  : T extends object ? { [K in keyof T]: Json<T[K]> } : T;',
  'type SavedVariable = VariableModel & { definition?: string; auto?: boolean; auto_min?: string; auto_count?: number };',
  'type PrometheusAnnotation = AnnotationQuery<Prometheus> & {',
  '  titleFormat?: string; textFormat?: string; tagKeys?: string; useValueForTime?: boolean; step?: string;',
  '};',
  "type SavedDashboard = Omit<Dashboard, 'templating' | 'annotations'> & {",
  '  templating?: { list?: SavedVariable[] };',
  '  annotations?: { list?: PrometheusAnnotation[] };',
  '};',
  '',
].join('\n');

function literal(value) {
  return JSON.stringify(value, null, 1);
}

/** The virtual source of one dashboard, and where each panel's text lies in it (for naming errors). */
function dashboardSource(dashboard) {
  const spans = [];
  let text = PRELUDE;
  const mark = (panel, chunk) => {
    spans.push({ start: text.length, end: text.length + chunk.length, panel });
    text += chunk;
  };
  // The dashboard itself, with each panel's literal marked.
  const { panels = [], ...rest } = dashboard;
  text += `export const dashboard = {\n${literal(rest).slice(1, -1)},\n"panels": [\n`;
  for (const panel of panels) {
    if (panel.type === 'row' && panel.panels?.length) {
      const { panels: inner, ...row } = panel;
      mark(panel, `{${literal(row).slice(1, -1)}, "panels": [`);
      inner.forEach((child) => mark(child, `${literal(child)},\n`));
      text += ']},\n';
    } else {
      mark(panel, `${literal(panel)},\n`);
    }
  }
  text += `]} satisfies Json<SavedDashboard>;\n`;
  // Each panel's parts against its plugin's types.
  const all = panels.flatMap((p) => [p, ...(p.type === 'row' ? p.panels ?? [] : [])]);
  for (const panel of all) {
    const known = Object.keys(PANEL_TYPES).indexOf(panel.type);
    let chunk = '';
    if (known >= 0) {
      chunk += `export const options_${panel.id} = ${literal(panel.options ?? {})} satisfies Json<Partial<p${known}.Options>>;\n`;
      if (PANEL_TYPES[panel.type][1]) {
        chunk += `export const custom_${panel.id} = ${literal(panel.fieldConfig?.defaults?.custom ?? {})} satisfies Json<Partial<p${known}.FieldConfig>>;\n`;
      }
    } else if (panel.type !== 'row') {
      chunk += `export const type_${panel.id}: 'a panel type this check knows (${Object.keys(PANEL_TYPES).join(', ')})' = ${JSON.stringify(panel.type)};\n`;
    }
    (panel.targets ?? []).forEach((target, i) => {
      chunk += `export const target_${panel.id}_${i} = ${literal(target)} satisfies Json<Prometheus>;\n`;
    });
    if (chunk) {
      mark(panel, chunk);
    }
  }
  return { text, spans };
}

function where(spans, position) {
  const inside = spans.filter((s) => s.start <= position && position < s.end);
  const panel = inside.length ? inside[inside.length - 1].panel : null;
  return panel ? `panel "${panel.title}" (id ${panel.id}, ${panel.type})` : 'dashboard';
}

/** Problems found in the files, one line each naming the file and the panel; empty when all validate. */
export function validateDashboards(files) {
  const problems = [];
  const sources = new Map();
  for (const file of files) {
    let dashboard;
    try {
      dashboard = JSON.parse(readFileSync(file, 'utf8'));
    } catch (err) {
      problems.push(`${file}: cannot read as JSON: ${err.message}`);
      continue;
    }
    sources.set(path.join(HERE, `.validate-${sources.size}.ts`), { file, ...dashboardSource(dashboard) });
  }
  if (!sources.size) {
    return problems;
  }
  const options = {
    strict: true, noEmit: true, skipLibCheck: true, target: ts.ScriptTarget.ES2022,
    module: ts.ModuleKind.ESNext, moduleResolution: ts.ModuleResolutionKind.Bundler, types: [],
  };
  const host = ts.createCompilerHost(options);
  const readFile = host.readFile.bind(host);
  const getSourceFile = host.getSourceFile.bind(host);
  host.fileExists = (name) => sources.has(name) || ts.sys.fileExists(name);
  host.readFile = (name) => sources.get(name)?.text ?? readFile(name);
  host.getSourceFile = (name, version) => (sources.has(name)
    ? ts.createSourceFile(name, sources.get(name).text, version)
    : getSourceFile(name, version));
  const program = ts.createProgram([...sources.keys()], options, host);
  for (const diagnostic of ts.getPreEmitDiagnostics(program)) {
    const source = diagnostic.file && sources.get(diagnostic.file.fileName);
    const message = ts.flattenDiagnosticMessageText(diagnostic.messageText, ' ');
    problems.push(source ? `${source.file}: ${where(source.spans, diagnostic.start)}: ${message}` : `validate: ${message}`);
  }
  return problems;
}

if (process.argv[1] === fileURLToPath(import.meta.url)) {
  const files = process.argv.slice(2);
  if (!files.length) {
    console.error('usage: node validate.mjs DASHBOARD.json...');
    process.exit(2);
  }
  const problems = validateDashboards(files);
  problems.forEach((line) => console.error(line));
  if (!problems.length) {
    console.log(`${files.join(', ')}: valid against @grafana/schema ${JSON.parse(readFileSync(path.join(HERE, 'node_modules/@grafana/schema/package.json'), 'utf8')).version}`);
  }
  process.exit(problems.some((line) => line.includes('cannot read as JSON')) ? 2 : problems.length ? 1 : 0);
}
