// Cost per user: draws the two charts from the data the page hands over in #cost-chart-data.
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("cost-chart-data").textContent);
  const config = { responsive: true, displaylogo: false };
  const margin = { l: 60, r: 20, t: 10, b: 40 };

  Plotly.newPlot("cost-histogram", [{
    type: "bar",
    x: data.histogram.x,
    y: data.histogram.y,
    marker: { color: "#2f5bd3" },
    hovertemplate: "%{x}<br>%{y} users<extra></extra>",
  }], {
    margin: margin,
    // Bins are log-spaced, so the labels are ranges of dollars, not a linear axis.
    xaxis: { type: "category", tickangle: -45, automargin: true, title: { text: "cost per user in the period" } },
    yaxis: { title: { text: "users" }, rangemode: "tozero" },
    bargap: 0.05,
  }, config);

  Plotly.newPlot("cost-concentration", [{
    type: "scatter",
    mode: "lines",
    x: data.concentration.x,
    y: data.concentration.y,
    line: { color: "#2f5bd3", width: 2 },
    name: "actual",
    hovertemplate: "top %{x:.1f}% of users: %{y:.1f}% of spend<extra></extra>",
  }, {
    type: "scatter",
    mode: "lines",
    x: [0, 100],
    y: [0, 100],
    line: { color: "#aab3c5", dash: "dot" },
    name: "everyone equal",
    hoverinfo: "skip",
  }], {
    margin: { l: 60, r: 20, t: 10, b: 50 },
    xaxis: { title: { text: "top % of users (biggest spenders first)" }, range: [0, 100], ticksuffix: "%" },
    yaxis: { title: { text: "% of all spend" }, range: [0, 100], ticksuffix: "%" },
    legend: { x: 0.6, y: 0.1 },
  }, config);
})();
