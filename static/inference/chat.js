// The chat page: one websocket, the conversation kept in the page, model output inserted as text.
(function () {
  "use strict";
  const config = JSON.parse(document.getElementById("chat-config").textContent);
  const transcript = document.getElementById("transcript");
  const statusLine = document.getElementById("status");
  const form = document.getElementById("composer");
  const prompt = document.getElementById("prompt");
  const featureSelect = document.getElementById("feature");
  const maxTokens = document.getElementById("max-tokens");
  const sendButton = document.getElementById("send");
  const cancelButton = document.getElementById("cancel");
  const allowanceLine = document.getElementById("allowance");

  const history = [];
  let socket = null;
  let current = null; // {item, text} of the answer being streamed
  let lastRequest = null; // {messages, max_tokens, feature}: what "retry with a shorter answer" resends
  let waiting = null; // {started, firstTokenAt, timer}: the visible "waiting for the model" state
  const RETRYABLE = new Set(["timeout", "engine_failed", "engine_unavailable", "internal", "worker_lost"]);

  function startWaiting() {
    stopWaiting();
    waiting = { started: performance.now(), firstTokenAt: null };
    waiting.timer = setInterval(() => {
      const seconds = ((performance.now() - waiting.started) / 1000).toFixed(1);
      statusLine.textContent = waiting.firstTokenAt ? `Answering… ${seconds} s` : `Waiting for the model… ${seconds} s`;
    }, 100);
  }

  function stopWaiting() {
    if (waiting) clearInterval(waiting.timer);
    waiting = null;
  }

  function offerShorterRetry(item) {
    if (!lastRequest) return;
    const shorter = Math.max(16, Math.floor(lastRequest.max_tokens / 2));
    const button = document.createElement("button");
    button.type = "button";
    button.className = "retry";
    button.textContent = `Retry with a shorter answer (${shorter} tokens)`;
    button.addEventListener("click", () => {
      button.remove();
      send({ ...lastRequest, max_tokens: shorter });
    });
    item.appendChild(button);
  }

  for (const name of config.features) {
    const option = document.createElement("option");
    option.value = name;
    option.textContent = name;
    featureSelect.appendChild(option);
  }
  // The feature staff marked as default (else "chat"), never simply the alphabetically first.
  if (config.default_feature) featureSelect.value = config.default_feature;
  // "Left today: 17 of 20 requests · 18,211 of 20,000 tokens · resets at 00:00 UTC, in 3 h 12 min"
  function showAllowance(allowance) {
    if (allowance === undefined) return; // a frame from a server that does not send it: keep the line
    if (allowance === null) {
      allowanceLine.textContent = "";
      return;
    }
    const parts = [];
    const count = (n) => Number(n).toLocaleString("en-US");
    if (allowance.requests) parts.push(`${count(allowance.requests.left)} of ${count(allowance.requests.limit)} requests`);
    if (allowance.tokens) parts.push(`${count(allowance.tokens.left)} of ${count(allowance.tokens.limit)} tokens`);
    if (allowance.cost_usd) parts.push(`$${Number(allowance.cost_usd.left).toFixed(2)} of $${Number(allowance.cost_usd.limit).toFixed(2)}`);
    // The guard counts no cached answer (docs/budgets.md, "Answer caches"), so neither does this line.
    allowanceLine.textContent = `Left today: ${parts.join(" · ")} · resets ${allowance.resets} · answers from the cache are free`;
  }
  showAllowance(config.allowance);

  maxTokens.value = config.default_max_tokens;
  maxTokens.max = config.max_tokens_limit;

  function addItem(role, text) {
    const item = document.createElement("li");
    item.className = role;
    item.textContent = text; // never innerHTML: model output is text
    transcript.appendChild(item);
    item.scrollIntoView({ block: "end" });
    return item;
  }

  function addMeta(item, text) {
    const meta = document.createElement("span");
    meta.className = "meta";
    meta.textContent = text;
    item.appendChild(meta);
  }

  function setBusy(busy) {
    sendButton.disabled = busy || !socket || socket.readyState !== WebSocket.OPEN;
    cancelButton.disabled = !busy;
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    socket = new WebSocket(`${scheme}://${location.host}/ws/chat/`);
    socket.addEventListener("open", () => {
      statusLine.textContent = "Connected.";
      setBusy(false);
    });
    socket.addEventListener("close", () => {
      statusLine.textContent = "Disconnected; reconnecting…";
      stopWaiting();
      if (current) finishAnswer("(connection lost)");
      setBusy(false);
      setTimeout(connect, 2000);
    });
    socket.addEventListener("message", (event) => handle(JSON.parse(event.data)));
  }

  function handle(frame) {
    switch (frame.type) {
      case "accepted":
        statusLine.textContent = `Thinking… (${frame.prompt_tokens} prompt tokens, up to ${frame.max_tokens} new)`;
        current = { item: addItem("assistant", ""), text: "", requestId: frame.request_id, nextSeq: 0, frames: 0, gap: false };
        break;
      case "token":
        if (!current) return;
        if (waiting && !waiting.firstTokenAt) waiting.firstTokenAt = performance.now();
        // The channel layer is at-most-once: a frame that skips a seq means some text never came.
        if (typeof frame.seq === "number") {
          if (frame.seq !== current.nextSeq) current.gap = true;
          current.nextSeq = frame.seq + 1;
        }
        current.frames += 1;
        current.text += frame.text;
        current.item.textContent = current.text;
        break;
      case "done":
        stopWaiting();
        if (current && frame.result === undefined && lostFrames(frame)) {
          recoverFromTranscript(current, frame);
          break;
        }
        if (frame.result !== undefined && current) {
          // An extract feature answers once with a JSON object: show it as text, pretty-printed.
          current.text = JSON.stringify(frame.result, null, 2);
          current.item.textContent = current.text;
        }
        showAllowance(frame.allowance);
        history.push({ role: "assistant", content: current ? current.text : "" });
        finishAnswer(
          `${frame.usage.completion_tokens} tokens · first token ${frame.ttft_ms} ms · total ${frame.total_ms} ms · ${frame.finish_reason}`
        );
        statusLine.textContent = "Ready.";
        break;
      case "notice":
        addItem("notice", frame.message);
        break;
      case "refused":
        stopWaiting();
        history.pop();
        addItem("notice", frame.message);
        showAllowance(frame.allowance);
        statusLine.textContent = "Refused.";
        setBusy(false);
        break;
      case "error": {
        stopWaiting();
        const item = current ? current.item : addItem("notice", frame.message);
        if (current) finishAnswer(frame.message);
        else setBusy(false);
        if (RETRYABLE.has(frame.code)) offerShorterRetry(item);
        else history.pop();
        statusLine.textContent = "Ready.";
        break;
      }
    }
  }

  // `frames` on done is how many token frames the server sent; fewer here (or a seq gap) means lost text.
  function lostFrames(done) {
    return current.gap || (typeof done.frames === "number" && current.frames < done.frames);
  }

  // The stored transcript is the whole answer: fetch it and show it instead of what arrived.
  async function recoverFromTranscript(answer, done) {
    current = null;
    statusLine.textContent = "Some of the answer was lost on the way; fetching it…";
    try {
      const response = await fetch(`/chat/requests/${encodeURIComponent(answer.requestId)}/`, {
        headers: { Accept: "application/json" },
        credentials: "same-origin",
      });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      const stored = await response.json();
      answer.text = stored.text;
      answer.item.textContent = answer.text;
      answer.item.dataset.recovered = "true";
    } catch (error) {
      addMeta(answer.item, `(part of this answer was lost: ${error.message})`);
    }
    answer.gap = false;
    current = answer;
    handle({ ...done, frames: undefined });
  }

  function finishAnswer(meta) {
    if (current) addMeta(current.item, meta);
    current = null;
    setBusy(false);
  }

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const text = prompt.value.trim();
    if (!text || !socket || socket.readyState !== WebSocket.OPEN) return;
    history.push({ role: "user", content: text });
    addItem("user", text);
    prompt.value = "";
    send({
      feature: featureSelect.value,
      messages: history.slice(),
      max_tokens: parseInt(maxTokens.value, 10) || config.default_max_tokens,
    });
  });

  function send(request) {
    lastRequest = request;
    setBusy(true);
    startWaiting();
    socket.send(JSON.stringify({ type: "chat", ...request }));
  }

  prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      form.requestSubmit();
    }
  });

  cancelButton.addEventListener("click", () => {
    stopWaiting();
    statusLine.textContent = "Stopped.";
    if (socket && socket.readyState === WebSocket.OPEN) socket.send(JSON.stringify({ type: "cancel" }));
    if (current) {
      history.push({ role: "assistant", content: current.text });
      finishAnswer("(stopped)");
    }
  });

  setBusy(false);
  connect();
})();
