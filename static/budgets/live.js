// The staff live feed (/ws/dashboard/): calls onPoint for each settled request, onEngine each second.
window.CeilingLive = function (handlers) {
  "use strict";
  const status = document.getElementById("live-status");
  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const socket = new WebSocket(`${scheme}://${location.host}/ws/dashboard/`);
    socket.addEventListener("open", () => { if (status) status.textContent = "live"; });
    socket.addEventListener("close", () => {
      if (status) status.textContent = "reconnecting…";
      setTimeout(connect, 2000);
    });
    socket.addEventListener("message", (event) => {
      const frame = JSON.parse(event.data);
      if (frame.type === "point" && handlers.onPoint) handlers.onPoint(frame);
      if (frame.type === "engine" && handlers.onEngine) handlers.onEngine(frame.workers);
    });
  }
  connect();
};
