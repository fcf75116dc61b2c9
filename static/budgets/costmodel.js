// Cost model charts: the per-user monthly cost distribution with percentiles marked, and cost vs prompt.
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("costmodel-data").textContent);
  const config = { displayModeBar: false, responsive: true };
  const hist = data.histogram;
  const centers = hist.counts.map((_, i) => (hist.edges[i] + hist.edges[i + 1]) / 2);
  const marks = ["p50", "p90", "p99"].map((name) => ({
    type: "line", x0: hist.percentiles[name], x1: hist.percentiles[name], yref: "paper", y0: 0, y1: 1,
    line: { dash: "dot", color: "#b42318" },
  }));
  const labels = ["p50", "p90", "p99"].map((name) => ({
    x: hist.percentiles[name], yref: "paper", y: 1, text: name, showarrow: false, yanchor: "bottom",
  }));
  Plotly.newPlot("cost-histogram", [{ type: "bar", x: centers, y: hist.counts, name: "users" }], {
    margin: { t: 20, r: 10, b: 40, l: 50 }, height: 320, shapes: marks, annotations: labels,
    xaxis: { title: { text: "$ per user per month" } }, yaxis: { title: { text: "users" }, type: "log" },
  }, config);
  const points = data.cost_vs_prompt;
  Plotly.newPlot("cost-vs-prompt", [{ type: "scatter", mode: "markers", x: points.prompt_tokens, y: points.cost_usd, marker: { size: 3, opacity: 0.5 } }], {
    margin: { t: 20, r: 10, b: 40, l: 60 }, height: 320,
    xaxis: { title: { text: "prompt tokens" } }, yaxis: { title: { text: "$ per request" } },
  }, config);
})();
