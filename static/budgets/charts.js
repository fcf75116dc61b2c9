// Live charts: drawn from SQL aggregates, then one point per settled request folded into its bucket.
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("charts-data").textContent);
  const bucketMs = data.bucket_s * 1000;
  const config = { displayModeBar: false, responsive: true };
  const layout = {
    margin: { t: 10, r: 10, b: 40, l: 60 },
    height: 300,
    xaxis: { type: "date", range: data.x_range },
    legend: { orientation: "h" },
  };

  function traces(series, options) {
    return Object.entries(series.traces).map(([name, y]) => ({ name, x: series.x.slice(), y: y.slice(), ...options }));
  }
  const scaleCost = (s) => ({ x: s.x, traces: Object.fromEntries(Object.entries(s.traces).map(([k, v]) => [k, v.map((c) => c / 1e6)])) });

  // Stacked bars: one bar per bucket reads well for sparse traffic as for busy hours.
  Plotly.newPlot("tokens-chart", traces(data.series.tokens, { type: "bar" }), { ...layout, barmode: "stack" }, config);
  Plotly.newPlot("cost-chart", traces(scaleCost(data.series.cost), { type: "bar" }), { ...layout, barmode: "stack" }, config);
  Plotly.newPlot("refusals-chart", traces(data.refusals, { type: "bar" }), { ...layout, barmode: "stack" }, config);
  Plotly.newPlot(
    "latency-chart",
    [
      ...traces(data.series.ttft, { type: "scatter", mode: "lines+markers" }).map((t) => ({ ...t, name: `${t.name} TTFT` })),
      ...traces(data.series.total, { type: "scatter", mode: "lines", line: { dash: "dot" } }).map((t) => ({ ...t, name: `${t.name} total` })),
    ],
    layout,
    config
  );

  // The latency budget of a docs answer, stacked: where its time went, bucket by bucket.
  Plotly.newPlot("retrieval-latency-chart", traces(data.retrieval_latency, { type: "bar" }), { ...layout, barmode: "stack" }, config);

  function bucketOf(isoTime) {
    const t = new Date(isoTime).getTime();
    return new Date(Math.floor(t / bucketMs) * bucketMs).toISOString();
  }

  // Add `value` to trace `name` at the point's bucket, creating the trace or the bucket as needed.
  function addTo(chartId, name, bucket, value, options) {
    const chart = document.getElementById(chartId);
    let trace = chart.data.find((t) => t.name === name);
    if (!trace) {
      trace = { name, x: [], y: [], ...options };
      Plotly.addTraces(chart, trace);
      trace = chart.data[chart.data.length - 1];
    }
    const at = trace.x.findIndex((x) => new Date(x).getTime() === new Date(bucket).getTime());
    if (at === -1) {
      trace.x.push(bucket);
      trace.y.push(value);
    } else {
      trace.y[at] = (trace.y[at] || 0) + value;
    }
    Plotly.redraw(chart);
  }

  window.CeilingLive({
    onPoint(point) {
      if (data.tag) return; // the live feed carries no tags: a tagged view would gain untagged points
      const bucket = bucketOf(point.at);
      if (point.status === "refused") {
        addTo("refusals-chart", point.refusal_code || "refused", bucket, 1, { type: "bar" });
        return;
      }
      addTo("tokens-chart", point.feature, bucket, point.tokens, { type: "bar" });
      addTo("cost-chart", point.feature, bucket, point.cost_micro_usd / 1e6, { type: "bar" });
    },
  });
})();
