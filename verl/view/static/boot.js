// Loaded first: every script error and unhandled promise rejection is written into #js-errors (shown, and
// checked empty by the browser tests), so a broken view is never silently blank.
(function () {
  "use strict";
  function record(text) {
    var el = document.getElementById("js-errors");
    if (!el) {
      window.__verlEarlyErrors = (window.__verlEarlyErrors || []).concat([text]);
      return;
    }
    el.textContent += text + "\n";
    el.hidden = false;
  }
  window.__verlRecordError = record;
  window.addEventListener("error", function (e) {
    record("error: " + (e.message || "unknown") + " at " + (e.filename || "?") + ":" + (e.lineno || "?"));
  });
  window.addEventListener("unhandledrejection", function (e) {
    var r = e.reason;
    record("unhandled rejection: " + (r && r.stack ? r.stack : String(r)));
  });
  document.addEventListener("securitypolicyviolation", function (e) {
    record("blocked by the page's security policy: " + e.violatedDirective + " " + (e.blockedURI || ""));
  });
})();
