// Draws dashboards with Grafana 12.4's frontend code in Debian's Chromium and writes, per dashboard,
// one PNG per panel and per row and displayed.json (what each panel displays).
//
//   node render.mjs --prometheus URL --out DIR [--range 1h] [--end EPOCH_MS] [--scrape-interval 5s]
//                   [--var NAME=VALUE]... [--panel-timeout 20s] [--width 1200] DASHBOARD.json...
//
// Exit 0 when every panel drew; 1 naming each panel whose query failed (or that did not draw in
// time) or each dashboard that does not validate against @grafana/schema; 2 on bad arguments.
import { createReadStream, existsSync, mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import http from 'node:http';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium } from 'playwright-core';

import { validateDashboards } from './validate.mjs';

const HERE = path.dirname(fileURLToPath(import.meta.url));
const DIST = path.join(HERE, 'dist');
const CHROMIUM = '/usr/bin/chromium';
const CHROMIUM_ARGS = ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking'];
const TYPES = { '.html': 'text/html', '.js': 'text/javascript', '.css': 'text/css', '.json': 'application/json',
  '.svg': 'image/svg+xml', '.ttf': 'font/ttf', '.woff': 'font/woff', '.woff2': 'font/woff2' };
const PANEL_CONCURRENCY = 4; // as src/main.jsx runs them

class UsageError extends Error {}

function duration(text, flag) {
  const match = /^(\d+(?:\.\d+)?)(ms|s|m|h|d)$/.exec(text ?? '');
  if (!match) {
    throw new UsageError(`${flag}: expected a duration such as 15s or 1h, got ${JSON.stringify(text)}`);
  }
  return Number(match[1]) * { ms: 1, s: 1000, m: 60000, h: 3600000, d: 86400000 }[match[2]];
}

export function parseArgs(argv) {
  const args = { variables: {}, files: [], scrapeInterval: '5s', panelTimeoutMs: 20000, width: 1200 };
  for (let i = 0; i < argv.length; i++) {
    const flag = argv[i];
    const value = () => {
      if (i + 1 >= argv.length) {
        throw new UsageError(`${flag} needs a value`);
      }
      return argv[++i];
    };
    if (flag === '--prometheus') args.prometheus = value().replace(/\/$/, '');
    else if (flag === '--out') args.out = value();
    else if (flag === '--range') args.rangeMs = duration(value(), flag);
    else if (flag === '--end') args.end = Number(value());
    else if (flag === '--scrape-interval') {
      args.scrapeInterval = value();
      duration(args.scrapeInterval, flag);
    }
    else if (flag === '--panel-timeout') args.panelTimeoutMs = duration(value(), flag);
    else if (flag === '--width') args.width = Number(value());
    else if (flag === '--var') {
      const [name, ...rest] = value().split('=');
      if (!rest.length) {
        throw new UsageError(`--var ${argv[i]}: expected NAME=VALUE`);
      }
      args.variables[name] = rest.join('=');
    } else if (flag.startsWith('--')) throw new UsageError(`unknown option ${flag}`);
    else args.files.push(flag);
  }
  if (!args.prometheus || !args.out || !args.files.length) {
    throw new UsageError('usage: node render.mjs --prometheus URL --out DIR [options] DASHBOARD.json...');
  }
  if (!Number.isFinite(args.width) || args.width < 400) {
    throw new UsageError('--width: expected a number of pixels, at least 400');
  }
  return args;
}

/** dist/ as static files, /input/N.json as the page's input, /prometheus/* passed to Prometheus. */
function startServer(inputs, prometheus) {
  const server = http.createServer((request, response) => {
    const url = new URL(request.url, 'http://localhost');
    if (url.pathname.startsWith('/prometheus/')) {
      const target = new URL(prometheus + url.pathname.slice('/prometheus'.length) + url.search);
      const upstream = http.get(target, (answer) => {
        response.writeHead(answer.statusCode, { 'content-type': answer.headers['content-type'] ?? 'application/json' });
        answer.pipe(response);
      });
      upstream.on('error', (err) => {
        response.writeHead(502, { 'content-type': 'application/json' });
        response.end(JSON.stringify({ status: 'error', errorType: 'unreachable', error: `${prometheus}: ${err.message}` }));
      });
      return;
    }
    const input = /^\/input\/(\d+)\.json$/.exec(url.pathname);
    if (input) {
      response.writeHead(200, { 'content-type': 'application/json' });
      response.end(JSON.stringify(inputs[Number(input[1])]));
      return;
    }
    const file = path.join(DIST, path.normalize(url.pathname === '/' ? '/index.html' : url.pathname));
    if (!file.startsWith(DIST) || !existsSync(file)) {
      response.writeHead(404);
      response.end();
      return;
    }
    response.writeHead(200, { 'content-type': TYPES[path.extname(file)] ?? 'application/octet-stream' });
    createReadStream(file).pipe(response);
  });
  return new Promise((resolve) => server.listen(0, '127.0.0.1', () => resolve(server)));
}

function slug(text) {
  return text.toLowerCase().replace(/[^a-z0-9]+/g, '-').replace(/^-|-$/g, '') || 'untitled';
}

/** The dashboard's saved time range (now-1h .. now) unless --range says otherwise. */
function timeRange(dashboard, args) {
  const end = args.end ?? Date.now();
  const saved = /^now-(\d+[smhd])$/.exec(dashboard.time?.from ?? '');
  const rangeMs = args.rangeMs ?? (saved ? duration(saved[1], 'time.from') : 3600000);
  return { from: end - rangeMs, to: end };
}

async function renderDashboard(browser, baseUrl, index, dashboard, args) {
  const outDir = path.join(args.out, dashboard.uid);
  mkdirSync(outDir, { recursive: true });
  const page = await browser.newPage({ viewport: { width: args.width + 16, height: 1000 }, deviceScaleFactor: 1 });
  const problems = [];
  page.on('pageerror', (err) => problems.push(`page error: ${err.message}`));
  await page.goto(`${baseUrl}/index.html?input=/input/${index}.json`);
  const panels = (dashboard.panels ?? []).flatMap((p) => (p.type === 'row' ? p.panels ?? [] : [p])).length;
  // Every panel has its own time limit inside the page; this only catches a page that stopped altogether.
  const pageLimit = 30000 + args.panelTimeoutMs * Math.ceil(panels / PANEL_CONCURRENCY) * 2;
  try {
    await page.waitForFunction(() => window.__renderDone === true, null, { timeout: pageLimit, polling: 200 });
  } catch {
    problems.push(`the page did not finish within ${pageLimit / 1000} s`);
  }
  const displayed = await page.evaluate(() => window.__displayed ?? null);
  if (!displayed) {
    await page.close();
    return { displayed: { uid: dashboard.uid, error: problems.join('; ') || 'the page did not start' }, problems };
  }
  if (displayed.error) {
    problems.push(displayed.error);
  }
  for (const record of displayed.panels) {
    const file = `${String(record.id).padStart(2, '0')}-${slug(record.title)}.png`;
    await page.locator(`[data-panel-id="${record.id}"]`).screenshot({ path: path.join(outDir, file) });
    record.png = file;
    if (record.error) {
      problems.push(`panel "${record.title}" (id ${record.id}): ${record.error}`);
    } else if (!record.drawn) {
      problems.push(`panel "${record.title}" (id ${record.id}): not drawn when the page finished`);
    }
  }
  for (const row of displayed.rows) {
    const file = `row-${String(row.index + 1).padStart(2, '0')}-${slug(row.title)}.png`;
    await page.locator(`section[data-row-index="${row.index}"]`).screenshot({ path: path.join(outDir, file) });
    row.png = file;
  }
  writeFileSync(path.join(outDir, 'displayed.json'), `${JSON.stringify(displayed, null, 1)}\n`);
  await page.close();
  return { displayed, problems };
}

export async function main(argv) {
  let args;
  try {
    args = parseArgs(argv);
  } catch (err) {
    if (err instanceof UsageError) {
      console.error(err.message);
      return 2;
    }
    throw err;
  }
  if (!existsSync(path.join(DIST, 'index.html'))) {
    console.error(`${DIST}/index.html is missing: build the page first (npm run build, or make dashboards-render)`);
    return 2;
  }
  const invalid = validateDashboards(args.files);
  if (invalid.length) {
    invalid.forEach((line) => console.error(line));
    return invalid.some((line) => line.includes('cannot read')) ? 2 : 1;
  }
  const dashboards = args.files.map((file) => JSON.parse(readFileSync(file, 'utf8')));
  const inputs = dashboards.map((dashboard) => ({
    dashboard, prometheus: '/prometheus', ...timeRange(dashboard, args), scrapeInterval: args.scrapeInterval,
    variables: args.variables, panelTimeoutMs: args.panelTimeoutMs, width: args.width,
  }));
  const server = await startServer(inputs, args.prometheus);
  const browser = await chromium.launch({ executablePath: CHROMIUM, args: CHROMIUM_ARGS });
  let failed = false;
  try {
    for (const [index, dashboard] of dashboards.entries()) {
      const started = Date.now();
      const { displayed, problems } = await renderDashboard(browser, `http://127.0.0.1:${server.address().port}`, index, dashboard, args);
      const count = displayed.panels?.length ?? 0;
      console.log(`${args.files[index]}: ${count} panels, ${displayed.rows?.length ?? 0} rows drawn into ` +
        `${path.join(args.out, dashboard.uid)} in ${((Date.now() - started) / 1000).toFixed(1)} s`);
      for (const problem of problems) {
        console.error(`${args.files[index]}: ${problem}`);
        failed = true;
      }
    }
  } finally {
    await browser.close();
    server.close();
  }
  return failed ? 1 : 0;
}

if (process.argv[1] === fileURLToPath(import.meta.url)) {
  process.exitCode = await main(process.argv.slice(2));
}
