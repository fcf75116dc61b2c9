// Overview: spend against each provider ceiling, tokens per feature today, live engine panel.
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("overview-data").textContent);
  const layout = { margin: { t: 10, r: 10, b: 40, l: 60 }, height: 240 };
  const config = { displayModeBar: false, responsive: true };

  const providers = data.providers;
  if (providers.length) Plotly.newPlot("spend-chart", [
    { type: "bar", orientation: "h", name: "spent ($)", y: providers.map((p) => p.name), x: providers.map((p) => p.spent_micro_usd / 1e6) },
    { type: "scatter", mode: "markers", name: "ceiling ($)", marker: { symbol: "line-ns-open", size: 24, color: "#b42318" },
      y: providers.map((p) => p.name), x: providers.map((p) => (p.limit_micro_usd == null ? null : p.limit_micro_usd / 1e6)) },
  ], { ...layout, showlegend: true }, config);

  const features = data.features;
  const featureIndex = new Map(features.map((f, i) => [f.name, i]));
  Plotly.newPlot("features-chart", [{ type: "bar", x: features.map((f) => f.name), y: features.map((f) => f.tokens) }], layout, config);

  function text(id, value) { document.getElementById(id).textContent = value; }
  function bump(id) { const el = document.getElementById(id); el.textContent = String(Number(el.textContent) + 1); }

  window.CeilingLive({
    onPoint(point) {
      bump("kpi-requests");
      if (point.status === "refused") { bump("kpi-refused"); return; }
      if (point.status === "failed") bump("kpi-failed");
      const chart = document.getElementById("features-chart");
      const trace = chart.data[0];
      if (!featureIndex.has(point.feature)) {
        featureIndex.set(point.feature, trace.x.length);
        trace.x.push(point.feature);
        trace.y.push(0);
      }
      trace.y[featureIndex.get(point.feature)] += point.tokens;
      Plotly.redraw(chart);
    },
    onEngine(workers) {
      const body = document.querySelector("#engine-panel tbody");
      body.replaceChildren();
      if (!workers.length) {
        const row = body.insertRow();
        const cell = row.insertCell();
        cell.colSpan = 6;
        cell.textContent = "No worker is reporting.";
        return;
      }
      // A worker reports its default engine, plus one entry per other weight variant it loaded.
      for (const w of workers) {
        for (const engine of [w, ...(w.variants || [])]) {
          const row = body.insertRow();
          const weights = `${engine.quantization || "none"} · ${Math.round((engine.weights_bytes || 0) / 1048576)} MiB`;
          for (const value of [w.worker, engine.running, engine.waiting, `${engine.kv_blocks_used} / ${engine.kv_blocks_total}`, engine.tokens_per_s, weights]) {
            const cell = row.insertCell();
            cell.textContent = value; // text, never HTML
          }
        }
      }
    },
  });
})();
