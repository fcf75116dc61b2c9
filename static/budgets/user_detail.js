// Typing a cap in a row that follows the default switches that row to "Own", so what was typed is kept.
document.getElementById("caps-form").addEventListener("input", (event) => {
  if (!event.target.classList.contains("cap-input")) return;
  const source = event.target.closest("tr").querySelector("select.source");
  if (source) source.value = "own";
});
