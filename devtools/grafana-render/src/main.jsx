// One dashboard drawn by Grafana 12.4's frontend code against a live Prometheus.
//
// The page reads its input (dashboard JSON, Prometheus base URL, time range, scrape interval,
// variable choices, per-panel time limit) from the JSON file named by ?input=..., draws every row
// with its panels at their grid size, and leaves what each panel displays in window.__displayed
// once window.__renderDone is true (render.mjs reads both).
import React from 'react';
import { createRoot } from 'react-dom/client';
import { ThemeContext, applyFieldOverrides, createTheme, dateTime, standardTransformers,
  standardTransformersRegistry, transformDataFrame } from '@grafana/data';
import { ErrorBoundary, GlobalStyles, PanelChrome } from '@grafana/ui';

import { annotationEvents, drawAnnotations } from './annotations';
import { effectiveFieldConfig, fieldConfigRegistry, SUPPORTED_PANELS } from './fieldConfig';
import { VISUALISATIONS } from './panels';
import { Prometheus, labelValues, panelIntervals, runPanelQueries } from './prometheus';
import { readBack } from './readback';

// react-grid-layout as Grafana's dashboard grid sets it up (public/app/core/constants.ts).
const GRID_CELL_HEIGHT = 30;
const GRID_CELL_MARGIN = 8;
const GRID_COLUMNS = 24;
const PANEL_CONCURRENCY = 4;

const theme = createTheme(); // Grafana's default: dark

// Core Grafana registers its transformers at start-up; @grafana/data's standard ones are what dashboards use.
// (Some are listed under two names, e.g. seriesToColumns and joinByField: one entry per id.)
standardTransformersRegistry.setInit(() => [...new Map(Object.values(standardTransformers).map((transformer) => [
  transformer.id,
  { id: transformer.id, name: transformer.name, description: transformer.description, transformation: transformer,
    editor: () => null, imageDark: '', imageLight: '' },
])).values()]);

/** Rows in dashboard order, each with its panels (expanded rows are followed by theirs, collapsed rows hold them). */
export function dashboardRows(dashboard) {
  const rows = [];
  for (const panel of dashboard.panels ?? []) {
    if (panel.type === 'row') {
      rows.push({ title: panel.title, y: panel.gridPos?.y ?? 0, panels: [...(panel.panels ?? [])] });
    } else {
      if (!rows.length) {
        rows.push({ title: '', y: 0, panels: [] });
      }
      rows[rows.length - 1].panels.push(panel);
    }
  }
  return rows;
}

function gridBox(gridPos, rowTop, width) {
  const column = (width - GRID_CELL_MARGIN * (GRID_COLUMNS - 1)) / GRID_COLUMNS;
  return {
    left: gridPos.x * (column + GRID_CELL_MARGIN),
    top: (gridPos.y - rowTop) * (GRID_CELL_HEIGHT + GRID_CELL_MARGIN),
    width: Math.round(gridPos.w * column + (gridPos.w - 1) * GRID_CELL_MARGIN),
    height: gridPos.h * GRID_CELL_HEIGHT + (gridPos.h - 1) * GRID_CELL_MARGIN,
  };
}

/** Each variable's value as Grafana resolves it on load: its saved choice, All, or the first value listed. */
async function resolveVariables(dashboard, prometheus, chosen, timeRange) {
  const variables = {};
  for (const model of dashboard.templating?.list ?? []) {
    if (model.type !== 'query') {
      continue;
    }
    const options = await labelValues(prometheus, model.query, variables, timeRange);
    const atAll = model.includeAll && [model.current?.value].flat().includes('$__all');
    let value;
    if (model.name in chosen) {
      value = model.multi ? [chosen[model.name]] : chosen[model.name];
    } else if (atAll) {
      value = model.allValue ?? options; // scenes' MultiValueVariable: without allValue, All is every listed value
    } else {
      value = model.multi ? options.slice(0, 1) : (options[0] ?? '');
    }
    variables[model.name] = { value, model, options, customAll: atAll && !(model.name in chosen) && model.allValue != null };
  }
  return variables;
}

function withTimeout(promise, ms, controller) {
  let timer;
  return Promise.race([
    promise,
    new Promise((_, reject) => {
      timer = setTimeout(() => {
        controller.abort();
        reject(new Error(`no answer within the panel time limit (${ms / 1000} s)`));
      }, ms);
    }),
  ]).finally(() => clearTimeout(timer));
}

function transformed(frames, transformations) {
  if (!transformations?.length) {
    return Promise.resolve(frames);
  }
  return new Promise((resolve, reject) => {
    const subscription = transformDataFrame(transformations, frames).subscribe({
      next: (out) => {
        resolve(out);
        setTimeout(() => subscription?.unsubscribe());
      },
      error: reject,
    });
  });
}

/** A panel's data as its visualisation receives it: queried, converted, transformed, field config applied. */
async function panelData(panel, context, innerWidth) {
  const controller = new AbortController();
  const intervals = panelIntervals(context.timeRange, panel.maxDataPoints ?? innerWidth, context.scrapeInterval);
  const work = (async () => {
    const { queries, frames } = await runPanelQueries({
      panel, prometheus: context.prometheus, variables: context.variables, timeRange: context.timeRange,
      intervals, signal: controller.signal,
    });
    const fieldConfig = effectiveFieldConfig(panel);
    const series = applyFieldOverrides({
      data: await transformed(frames, panel.transformations),
      fieldConfig,
      fieldConfigRegistry: fieldConfigRegistry(fieldConfig),
      replaceVariables: (text) => text,
      theme,
      timeZone: 'browser',
    });
    return { queries, series, fieldConfig };
  })();
  return { intervals, ...(await withTimeout(work, context.panelTimeoutMs, controller)) };
}

function Panel({ panel, box, context, record }) {
  const [state, setState] = React.useState({ loading: true });
  React.useEffect(() => {
    // PanelChrome's header (32 px) and padding (8 px each side) come off the panel's box.
    context.limit(() => panelData(panel, context, box.width - 16))
      .then((data) => {
        record.queries = data.queries;
        record.rateInterval = `${data.intervals.rateIntervalMs / 1000}s`;
        record.step = `${data.intervals.stepMs / 1000}s`;
        setState({ loading: false, ...data });
      })
      .catch((err) => {
        record.error = err.message;
        setState({ loading: false, series: [], fieldConfig: effectiveFieldConfig(panel) });
      });
  }, []);
  const Viz = VISUALISATIONS[panel.type];
  return (
    <div data-panel-id={panel.id} style={{ position: 'absolute', ...box }}>
      <PanelChrome width={box.width} height={box.height} title={panel.title} description={panel.description}
        loadingState={state.loading ? 'Loading' : record.error ? 'Error' : 'Done'} statusMessage={record.error}>
        {(width, height) => {
          if (state.loading) {
            return null;
          }
          if (!Viz) {
            record.error = `panel type ${panel.type} is not drawn (supported: ${SUPPORTED_PANELS.join(', ')})`;
            return <div>{record.error}</div>;
          }
          return (
            <ErrorBoundary onError={(err) => { record.error = `render: ${err.message}`; }}>
              {({ error }) => (error ? <div>{error.message}</div> : (
                <Viz panel={panel} series={state.series} fieldConfig={state.fieldConfig} width={width} height={height}
                  theme={theme} timeRange={context.timeRange} record={record} />
              ))}
            </ErrorBoundary>
          );
        }}
      </PanelChrome>
      <RenderedMarker done={!state.loading} record={record} />
    </div>
  );
}

function RenderedMarker({ done, record }) {
  React.useEffect(() => {
    if (done) {
      // uPlot and the table size themselves after mount: two frames later the panel is drawn.
      requestAnimationFrame(() => requestAnimationFrame(() => { record.drawn = true; }));
    }
  }, [done]);
  return null;
}

function Dashboard({ rows, context, records, width }) {
  return rows.map((row, index) => {
    const rowTop = row.y + 1;
    const boxes = row.panels.map((panel) => gridBox(panel.gridPos, rowTop, width));
    const height = Math.max(0, ...boxes.map((box) => box.top + box.height));
    return (
      <section key={index} data-row-index={index} style={{ width, padding: '0 0 8px 0' }}>
        <h6 style={{ margin: 0, padding: '8px 0', fontSize: 16, color: theme.colors.text.primary }}>{row.title}</h6>
        <div style={{ position: 'relative', width, height }}>
          {row.panels.map((panel, i) => (
            <Panel key={panel.id} panel={panel} box={boxes[i]} context={context} record={records[panel.id]} />
          ))}
        </div>
      </section>
    );
  });
}

/** Runs a few panels' queries at a time (2 cores, one Prometheus); each panel's time limit starts when it runs. */
function throttled(limit) {
  let running = 0;
  const waiting = [];
  const next = () => {
    if (running < limit && waiting.length) {
      running++;
      const { task, resolve, reject } = waiting.shift();
      task().then(resolve, reject).finally(() => { running--; next(); });
    }
  };
  return (task) => new Promise((resolve, reject) => { waiting.push({ task, resolve, reject }); next(); });
}

async function main() {
  const input = await (await fetch(new URLSearchParams(window.location.search).get('input'))).json();
  const { dashboard } = input;
  const timeRange = { from: dateTime(input.from), to: dateTime(input.to), raw: { from: dateTime(input.from), to: dateTime(input.to) } };
  const prometheus = new Prometheus(input.prometheus);
  const displayed = { uid: dashboard.uid, title: dashboard.title, from: input.from, to: input.to, variables: {}, rows: [], panels: [] };
  window.__displayed = displayed;
  try {
    const variables = await resolveVariables(dashboard, prometheus, input.variables ?? {}, timeRange);
    for (const [name, { value }] of Object.entries(variables)) {
      displayed.variables[name] = value;
    }
    const rows = dashboardRows(dashboard);
    const records = {};
    rows.forEach((row, index) => {
      displayed.rows.push({ index, title: row.title, panels: row.panels.map((p) => p.id) });
      for (const panel of row.panels) {
        records[panel.id] = { id: panel.id, title: panel.title, type: panel.type, row: row.title, gridPos: panel.gridPos };
        displayed.panels.push(records[panel.id]);
      }
    });
    const context = { prometheus, variables, timeRange, limit: throttled(PANEL_CONCURRENCY),
      scrapeInterval: input.scrapeInterval, panelTimeoutMs: input.panelTimeoutMs };
    createRoot(document.getElementById('root')).render(
      <ThemeContext.Provider value={theme}>
        <GlobalStyles />
        <div style={{ padding: 8, background: theme.colors.background.canvas, width: input.width + 16 }}>
          <Dashboard rows={rows} context={context} records={records} width={input.width} />
        </div>
      </ThemeContext.Provider>
    );
    const events = annotationEvents(dashboard, prometheus, variables, timeRange).catch((err) => {
      displayed.error = `annotations: ${err.message}`;
      return [];
    });
    await new Promise((resolve) => {
      const check = () => (Object.values(records).every((r) => r.drawn || r.error) ? resolve() : setTimeout(check, 100));
      check();
    });
    drawAnnotations(displayed, await events, timeRange, theme);
    // TableNG measures wrapped headers and cells with the page's font, and lays a table out again after it has
    // drawn: read back once the font is loaded and the tables' cells and texts stand still.
    await document.fonts.ready;
    await laidOut();
    readBack(displayed, theme);
  } catch (err) {
    displayed.error = err.message;
  }
  window.__renderDone = true;
}

/** Resolves once two frames in a row place every table cell and its text alike (at most 5 s). */
async function laidOut() {
  const frame = () => new Promise((resolve) => requestAnimationFrame(() => requestAnimationFrame(resolve)));
  const range = document.createRange();
  const places = () => [...document.querySelectorAll('[role="columnheader"], [role="gridcell"]')].map((cell) => {
    range.selectNodeContents(cell);
    const box = cell.getBoundingClientRect();
    const text = range.getBoundingClientRect();
    return [box.left, box.top, box.width, box.height, text.left, text.top, text.width].join(' ');
  }).join('|');
  const deadline = performance.now() + 5000;
  let last = null;
  while (performance.now() < deadline) {
    await frame();
    const now = places();
    if (now === last) {
      return;
    }
    last = now;
  }
}

main();
