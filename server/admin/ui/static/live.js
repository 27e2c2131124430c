// fedsplit web view: keep the open page current without a reload.
// Every POLL_MS the page re-requests itself with If-None-Match; on 304 nothing changes, on 200 each
// element marked data-live is replaced by the element with the same id in the new page. One request
// in flight at most, fixed interval, paused while the tab is hidden, stopped after repeated errors;
// a 401 (session ended) goes to the sign-in page. Nothing is stored in the browser.
(function () {
  "use strict";
  var POLL_MS = 2000;
  var MAX_ERRORS = 5;
  var etag = null;
  var errors = 0;
  var timer = null;
  var busy = false;
  var status = document.getElementById("live-status");

  function say(text) { if (status) { status.textContent = text; } }

  function apply(html) {
    var fresh = new DOMParser().parseFromString(html, "text/html");
    var regions = document.querySelectorAll("[data-live][id]");
    var changed = 0;
    for (var i = 0; i < regions.length; i++) {
      var old = regions[i];
      var next = fresh.getElementById(old.id);
      if (!next || next.innerHTML === old.innerHTML) { continue; }
      if (old.contains(document.activeElement) && document.activeElement !== document.body) {
        continue; // do not pull the focused element away from a keyboard user; next poll retries
      }
      old.innerHTML = next.innerHTML;
      changed += 1;
    }
    return changed;
  }

  function schedule() {
    if (timer === null) { timer = window.setTimeout(poll, POLL_MS); }
  }

  function poll() {
    timer = null;
    if (busy) { return; }
    if (document.hidden) { return; } // resumed by visibilitychange
    busy = true;
    var headers = { "X-Fedsplit-Live": "1" };
    if (etag) { headers["If-None-Match"] = etag; }
    fetch(window.location.pathname + window.location.search,
          { headers: headers, cache: "no-store", credentials: "same-origin", redirect: "error" })
      .then(function (response) {
        if (response.status === 401) { window.location.assign("/ui/login"); return null; }
        if (response.status === 304) { errors = 0; return null; }
        if (!response.ok) { throw new Error("HTTP " + response.status); }
        etag = response.headers.get("ETag");
        return response.text();
      })
      .then(function (html) {
        if (html !== null && apply(html) > 0) {
          say("Updated " + new Date().toLocaleTimeString());
        }
        errors = 0;
      })
      .catch(function () {
        errors += 1;
        say(errors >= MAX_ERRORS ? "Live updates stopped: the server does not answer. Reload to retry."
                                 : "Live update failed; retrying.");
      })
      .then(function () {
        busy = false;
        if (errors < MAX_ERRORS) { schedule(); }
      });
  }

  document.addEventListener("visibilitychange", function () {
    if (!document.hidden && errors < MAX_ERRORS) { schedule(); }
  });
  if (document.querySelector("[data-live]")) { schedule(); }
})();
