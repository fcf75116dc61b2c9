// Batch detail: poll the job's progress once a second until it finishes; outputs go in as text, never HTML.
(function () {
  "use strict";
  const config = JSON.parse(document.getElementById("batch-config").textContent);
  if (config.finished) return;

  function text(id, value) { document.getElementById(id).textContent = value; }

  function showItem(item) {
    const row = document.querySelector(`#batch-items tr[data-index="${item.index}"]`);
    if (!row) return;
    row.querySelector(".item-status").textContent = item.status || "waiting";
    row.querySelector(".item-request").textContent = item.request_id;
    const output = row.querySelector(".item-output");
    if (item.error) {
      const span = document.createElement("span");
      span.className = "alert";
      span.textContent = item.error;
      output.replaceChildren(span);
    } else {
      output.textContent = item.output;
    }
  }

  function show(progress) {
    const bar = document.getElementById("job-progress");
    bar.max = progress.total;
    bar.value = progress.processed;
    const status = document.getElementById("job-status");
    status.textContent = progress.status;
    status.className = `tag batch-${progress.status}`;
    text("job-processed", `${progress.processed}/${progress.total}`);
    text("job-done", progress.done);
    text("job-failed", progress.failed);
    progress.items.forEach(showItem);
  }

  async function poll() {
    try {
      const response = await fetch(config.progress_url, { headers: { Accept: "application/json" } });
      if (response.ok) {
        const progress = await response.json();
        show(progress);
        if (progress.finished) return;
      }
    } catch (error) {
      console.warn("batch progress:", error); // a network blip: try again next second
    }
    setTimeout(poll, 1000);
  }
  setTimeout(poll, 1000);
})();
