// Line plots on a canvas for the live view: each plot holds the last WINDOW_S seconds of its
// series and redraws on push. No library: the page fetches nothing from outside the server.
(function () {
"use strict";

const WINDOW_S = 120;

class LinePlot {
  // series: [{key, label, color}]; format: value -> text for the axis and the legend
  constructor(container, title, series, format) {
    this.series = series;
    this.format = format;
    this.points = series.map(() => []);
    const box = document.createElement("div");
    box.className = "plot";
    box.dataset.plot = title;
    const head = document.createElement("div");
    head.className = "title";
    const name = document.createElement("span");
    name.textContent = title;
    this.latest = document.createElement("span");
    head.append(name, this.latest);
    this.canvas = document.createElement("canvas");
    this.box = box;
    box.append(head, this.canvas);
    container.append(box);
  }

  // values: {key: number | null}; a null leaves a gap (no sample yet). draw: redraw now
  push(time, values, draw = true) {
    this.series.forEach((s, i) => {
      const v = values[s.key];
      this.points[i].push([time, v === undefined ? null : v]);
      while (this.points[i].length && this.points[i][0][0] < time - WINDOW_S) this.points[i].shift();
    });
    this.box.dataset.samples = String(this.points[0].length);
    this.box.dataset.latest = JSON.stringify(values); // the latest sample, for the page's tests
    if (!draw) return;
    this.latest.textContent = this.series
      .map((s) => s.label + " " + (values[s.key] == null ? "–" : this.format(values[s.key])))
      .join("  ");
    this.draw(time);
  }

  draw(now) {
    const c = this.canvas;
    const ratio = window.devicePixelRatio || 1;
    const w = c.clientWidth, h = c.clientHeight;
    if (!w || !h) return;
    if (c.width !== Math.round(w * ratio)) c.width = Math.round(w * ratio);
    if (c.height !== Math.round(h * ratio)) c.height = Math.round(h * ratio);
    const g = c.getContext("2d");
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    g.clearRect(0, 0, w, h);
    let top = 0;
    for (const pts of this.points) for (const [, v] of pts) if (v != null && v > top) top = v;
    top = top > 0 ? niceCeiling(top) : 1;
    const left = 44, bottom = h - 14;
    const x = (t) => left + ((t - (now - WINDOW_S)) / WINDOW_S) * (w - left - 4);
    const y = (v) => bottom - (v / top) * (bottom - 6);
    g.strokeStyle = "#2c323c";
    g.fillStyle = "#8a94a3";
    g.font = "10px system-ui, sans-serif";
    g.lineWidth = 1;
    for (const frac of [0, 0.5, 1]) {
      const yy = Math.round(y(top * frac)) + 0.5;
      g.beginPath(); g.moveTo(left, yy); g.lineTo(w - 4, yy); g.stroke();
      g.fillText(this.format(top * frac), 2, yy + 3);
    }
    g.fillText("-" + WINDOW_S + " s", left, h - 2);
    g.fillText("now", w - 24, h - 2);
    g.lineWidth = 1.5;
    this.series.forEach((s, i) => {
      g.strokeStyle = s.color;
      g.beginPath();
      let open = false;
      for (const [t, v] of this.points[i]) {
        if (v == null) { open = false; continue; }
        if (open) g.lineTo(x(t), y(v)); else g.moveTo(x(t), y(v));
        open = true;
      }
      g.stroke();
    });
  }
}

function niceCeiling(v) {
  const step = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * step >= v) return m * step;
  return 10 * step;
}

function formatSeconds(v) {
  if (v === 0) return "0";
  if (v >= 1) return v.toFixed(2) + " s";
  if (v >= 0.001) return (v * 1000).toFixed(v >= 0.1 ? 0 : 1) + " ms";
  return (v * 1e6).toFixed(0) + " µs";
}

function formatNumber(v) {
  if (v >= 1000) return (v / 1000).toFixed(1) + "k";
  return v >= 10 || v === 0 ? v.toFixed(0) : v.toFixed(1);
}

function formatPercent(v) {
  return (v * 100).toFixed(v > 0 && v < 0.1 ? 1 : 0) + "%";
}

window.PagodaPlots = { LinePlot, formatSeconds, formatNumber, formatPercent };
})();
