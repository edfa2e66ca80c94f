// What each drawn panel displays, read back from the page: the table's rows in their displayed
// order with each cell's text and background colour, the time series' and state timelines' legends, and the colour
// names of Grafana's palette for every colour (so a check can say "red", not "#F2495C").

/** Grafana's named colours (theme.visualization: "green", "dark-red", "super-light-blue", ...) by hex. */
function colourNames(theme) {
  const names = new Map();
  for (const hue of theme.visualization.hues) {
    for (const shade of hue.shades) {
      names.set(theme.visualization.getColorByName(shade.name).toLowerCase(), shade.name);
    }
  }
  return names;
}

function hex(cssColour) {
  const match = /rgba?\((\d+),\s*(\d+),\s*(\d+)(?:,\s*([\d.]+))?\)/.exec(cssColour ?? '');
  if (!match || match[4] === '0') {
    return null;
  }
  return `#${match.slice(1, 4).map((n) => Number(n).toString(16).padStart(2, '0')).join('')}`;
}

function named(names, colour) {
  const key = colour?.toLowerCase();
  return key ? { color: key, colorName: names.get(key) ?? null } : { color: null, colorName: null };
}

function text(element) {
  return element.innerText.replace(/\s+/g, ' ').trim();
}

/** Whether the element cuts its text short, or the panel cuts the element: a text laid out past the box (a
 * right-aligned cell overflows to the left, which no scroll width counts; an ellipsis is painted over text laid out
 * whole; wrapped lines the row is not tall enough for run into the next row), or the box past the panel's edge (a
 * table wider than its panel scrolls sideways). Text only: a header's hidden filter button may sit outside it. */
function clipped(element, panel) {
  const box = element.getBoundingClientRect();
  const edge = panel.getBoundingClientRect();
  if (box.left < edge.left - 0.5 || box.right > edge.right + 0.5) {
    return true;
  }
  const texts = document.createTreeWalker(element, NodeFilter.SHOW_TEXT);
  const range = document.createRange();
  for (let node = texts.nextNode(); node; node = texts.nextNode()) {
    for (const word of node.data.matchAll(/\S+/g)) { // word by word: a space hanging at a line's end is no text
      range.setStart(node, word.index);
      range.setEnd(node, word.index + word[0].length);
      const laid = range.getBoundingClientRect();
      if (laid.width > 0 && (laid.left < box.left - 0.5 || laid.right > box.right + 0.5
          || laid.top < box.top - 0.5 || laid.bottom > box.bottom + 0.5)) {
        return true;
      }
    }
  }
  return false;
}

/** TableNG (react-data-grid): header cells, then the data rows in the order they are displayed. */
function readTable(element, names) {
  const rows = [...element.querySelectorAll('[role="row"]')]
    .sort((a, b) => Number(a.getAttribute('aria-rowindex')) - Number(b.getAttribute('aria-rowindex')));
  const header = rows.find((row) => row.querySelector('[role="columnheader"]'));
  const headers = header ? [...header.querySelectorAll('[role="columnheader"]')] : [];
  const columns = headers.map(text);
  const body = rows.filter((row) => row !== header && row.querySelector('[role="gridcell"]'));
  return {
    columns,
    clippedColumns: columns.filter((column, index) => clipped(headers[index], element)),
    rows: body.map((row) => [...row.querySelectorAll('[role="gridcell"]')].map((cell, index) => ({
      column: columns[index] ?? null,
      text: text(cell),
      clipped: clipped(cell, element),
      ...named(names, hex(getComputedStyle(cell).backgroundColor)),
    }))),
  };
}

/** The first colour a legend item's series icon is painted in (SeriesIcon: a background). */
function iconColour(item) {
  for (const element of item.querySelectorAll('div, span')) {
    const colour = hex(getComputedStyle(element).backgroundColor);
    if (colour) {
      return colour;
    }
  }
  return null;
}

/** The boxes that clip what a legend shows: every element between it and the panel that does not let it overflow
 * (VizLayout's legend scrolls in at most 35 % of the panel's height below the graph). */
function clippingBoxes(element, legend) {
  const boxes = [];
  for (let box = legend.parentElement; box && box !== element.parentElement; box = box.parentElement) {
    if (getComputedStyle(box).overflowY !== 'visible') {
      boxes.push(box.getBoundingClientRect());
    }
  }
  return boxes;
}

/**
 * VizLegend: the table legend's rows (name, colour, one text per calculation, and whether the row is shown whole
 * without scrolling) or the list's items (name and colour).
 */
function readLegend(element, names) {
  const table = element.querySelector('table');
  if (table) {
    const calcs = [...table.querySelectorAll('thead th')].map(text).slice(1);
    const boxes = clippingBoxes(element, table);
    const header = table.querySelector('thead')?.getBoundingClientRect();
    return [...table.querySelectorAll('tbody tr')].map((row) => {
      const cells = [...row.querySelectorAll('td')];
      const shown = row.getBoundingClientRect();
      return {
        name: text(cells[0]),
        values: Object.fromEntries(calcs.map((calc, i) => [calc, cells[i + 1] ? text(cells[i + 1]) : null])),
        visible: shown.top >= (header?.bottom ?? shown.top) - 0.5
          && boxes.every((box) => shown.top >= box.top - 0.5 && shown.bottom <= box.bottom + 0.5),
        ...named(names, cells[0] && iconColour(cells[0])),
      };
    });
  }
  return [...element.querySelectorAll('li')].map((item) => ({ name: text(item), ...named(names, iconColour(item)) }));
}

export function readBack(displayed, theme) {
  const names = colourNames(theme);
  for (const record of displayed.panels) {
    const element = document.querySelector(`[data-panel-id="${record.id}"]`);
    if (!element) {
      continue;
    }
    const noData = element.querySelector('[data-no-data]');
    if (noData) {
      record.shows = text(noData); // "No data", or the panel's noValue
      continue;
    }
    for (const value of record.values ?? []) {
      Object.assign(value, named(names, value.color));
    }
    for (const lane of record.lanes ?? []) {
      Object.assign(lane, named(names, lane.color));
    }
    if (record.type === 'table') {
      Object.assign(record, readTable(element, names));
    } else if (record.type === 'timeseries' || record.type === 'state-timeline') {
      record.legend = readLegend(element, names);
    }
  }
}
