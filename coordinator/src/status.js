// The status page: polls /api/status and renders it. Every value from the
// coordinator goes into the page as text (text nodes, textContent) or as an
// attribute value, never as HTML.
"use strict";
(function () {
  const API = "/api/status";
  const POLL_MS = 2000;
  const STATES = ["done", "leased", "retrying", "pending"];
  const STATE_LABELS = { done: "done", leased: "leased", retrying: "retrying", pending: "pending" };
  // An ended job's unfinished shards wait for nothing.
  const ENDED_LABELS = { done: "done", leased: "leased", retrying: "failed", pending: "not done" };
  const STAGES = [
    ["input_wait_ms", "input wait", "st-input"],
    ["model_ms", "model", "st-model"],
    ["checkpoint_ms", "checkpoint", "st-checkpoint"],
  ];

  // The efficiency report's causes, in report order (`stoke report`).
  const CAUSES = [
    ["startup", "start-up", "cause-startup"],
    ["model", "model", "cause-model"],
    ["input_wait", "input wait", "cause-input"],
    ["checkpoint", "checkpoint", "cause-checkpoint"],
    ["redone", "redone", "cause-redone"],
    ["crashed", "crashed", "cause-crashed"],
    ["paused", "paused", "cause-paused"],
    ["tail_idle", "tail idle", "cause-tail"],
    ["other", "other", "cause-other"],
  ];

  let lastData = null;
  let lastOkAt = null;
  // <details> the user opened or closed, kept so across re-renders.
  const toggled = new Map();

  // el("div", { class: "x", "data-y": 1 }, child, "text", ...)
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined) continue;
      if (key === "class") node.className = value;
      else node.setAttribute(key, String(value));
    }
    for (const child of children) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function int(n) {
    return Number(n).toLocaleString("en-US");
  }

  function rate(r) {
    if (r === null || r === undefined) return "—";
    if (r < 10) return r.toFixed(1) + " rec/s";
    return int(Math.round(r)) + " rec/s";
  }

  function tokens(r) {
    if (r === null || r === undefined) return "—";
    if (r < 10) return r.toFixed(1) + "/s";
    return int(Math.round(r)) + "/s";
  }

  function duration(seconds) {
    if (seconds === null || seconds === undefined) return "—";
    let s = Math.round(seconds);
    if (s < 60) return s + "s";
    const d = Math.floor(s / 86400);
    s -= d * 86400;
    const h = Math.floor(s / 3600);
    s -= h * 3600;
    const m = Math.floor(s / 60);
    s -= m * 60;
    if (d > 0) return d + "d " + h + "h";
    if (h > 0) return h + "h " + String(m).padStart(2, "0") + "m";
    return m + "m " + String(s).padStart(2, "0") + "s";
  }

  function percent(done, total) {
    if (!total) return null;
    return Math.min(100, (100 * done) / total);
  }

  // Rounded down, so an unfinished job never shows 100%.
  function pctFixed(p) {
    return (Math.floor(p * 10) / 10).toFixed(1);
  }

  function pctText(p) {
    if (p === null) return "—";
    if (p >= 100) return "100%";
    return pctFixed(p) + "%";
  }

  function clock(ms) {
    return new Date(ms).toLocaleTimeString("en-GB", { hour12: false });
  }

  function tile(label, value, hint, attrs) {
    return el("div", Object.assign({ class: "tile" }, attrs || {}),
      el("div", { class: "label" }, label),
      el("div", { class: "value" }, value),
      hint ? el("div", { class: "hint" }, hint) : null);
  }

  function stat(label, value, cls, attrs) {
    return el("div", Object.assign({ class: "stat" }, attrs || {}),
      el("div", { class: "label" }, label),
      el("div", { class: "value" + (cls ? " " + cls : "") }, value));
  }

  function details(key, openByDefault, summary, ...content) {
    const node = el("details", { class: "errors", "data-key": key }, el("summary", {}, summary), ...content);
    node.open = toggled.has(key) ? toggled.get(key) : openByDefault;
    node.addEventListener("toggle", () => toggled.set(key, node.open));
    return node;
  }

  function renderSummary(data) {
    const running = data.jobs.filter((j) => j.state === "running");
    const leases = data.workers.reduce((n, w) => n + w.leases.length, 0);
    const known = running.filter((j) => j.records_per_s !== null);
    const throughput = known.reduce((n, j) => n + j.records_per_s, 0);
    const finished = data.jobs.filter((j) => j.state === "succeeded").length;
    return [
      tile("Running jobs", int(running.length), int(finished) + " succeeded · " + int(data.jobs.length) + " in all",
        { "data-running-jobs": running.length }),
      tile("Workers", int(data.workers.length), int(leases) + (leases === 1 ? " lease" : " leases") + " held",
        { "data-workers": data.workers.length }),
      tile("Throughput", known.length ? rate(throughput) : "—", "over the last " + data.rate_window_s + " s"),
      tile("Failed attempts", int(data.counters.attempts_failed),
        "since start · " + int(data.counters.leases_expired) + " leases expired"),
    ];
  }

  function renderErrors(job) {
    const e = job.errors;
    if (!e) return null;
    const parts = [];
    if (e.failed_shards_total) {
      parts.push(int(e.failed_shards_total) + (e.failed_shards_total === 1 ? " shard" : " shards") + " with failed attempts");
    }
    if (e.skipped_total) {
      parts.push(int(e.skipped_total) + (e.skipped_total === 1 ? " record" : " records") + " skipped");
    }
    const content = [];
    if (e.unavailable) content.push(el("p", { class: "note" }, "Errors could not be read: " + e.unavailable));
    if (e.failed_shards.length) {
      content.push(el("h3", {}, "Failed attempts"));
      content.push(el("table", { "data-failed-shards": e.failed_shards.length },
        el("thead", {}, el("tr", {}, el("th", {}, "Shard"), el("th", {}, "Failed"), el("th", {}, "Store"),
          el("th", {}, "Last worker"), el("th", {}, "Last error"))),
        el("tbody", {}, ...e.failed_shards.map((s) => el("tr", { "data-shard-id": s.shard_id },
          el("td", { class: "mono" }, s.shard_id),
          el("td", { class: "num" }, int(s.failed_attempts)),
          el("td", { class: "num" }, int(s.store_failures)),
          el("td", { class: "mono" }, s.last_failed_worker || "—"),
          el("td", { class: "mono" }, s.last_error || "—"))))));
      if (e.failed_shards_total > e.failed_shards.length) {
        content.push(el("p", { class: "note" }, "and " + int(e.failed_shards_total - e.failed_shards.length) + " more; stoke errors " + job.id + " lists them all"));
      }
    }
    if (e.skipped.length) {
      content.push(el("h3", {}, "Skipped records"));
      content.push(el("table", { "data-skipped": e.skipped.length },
        el("thead", {}, el("tr", {}, el("th", {}, "Shard"), el("th", {}, "Record"), el("th", {}, "Reason"))),
        el("tbody", {}, ...e.skipped.map((s) => el("tr", { class: "skipped-record" },
          el("td", { class: "mono" }, s.shard_id),
          el("td", { class: "mono record-id" }, s.id),
          el("td", {}, s.reason))))));
      if (e.skipped_total > e.skipped.length) {
        content.push(el("p", { class: "note" }, "and " + int(e.skipped_total - e.skipped.length) + " more; stoke errors " + job.id + " lists them all"));
      }
    }
    // Open while the job may still need someone; an ended job's are history.
    const open = job.state === "running" || job.state === "paused" || job.state === "failed";
    return details("errors:" + job.id, open, "Errors: " + (parts.join(" · ") || "see below"), ...content);
  }

  function renderJob(job) {
    const total = job.records_total;
    // A total not counted up front (large JSON Lines) is estimated from the
    // plan's bytes; progress and ETA then say they are estimates.
    const estimate = total === null ? (job.records_total_estimate ?? null) : null;
    const p = job.state === "succeeded" ? 100 : percent(job.records_done, total ?? estimate);
    const fill = el("div", { class: "fill" });
    fill.style.width = (p === null ? 0 : p) + "%";
    const bar = el("div", {
      class: "bar", role: "progressbar", "aria-valuemin": 0, "aria-valuemax": 100,
      "aria-valuenow": p === null ? null : pctFixed(p), "aria-label": "records done",
    }, fill);
    const segments = el("div", { class: "segments", "aria-hidden": "true" });
    for (const s of STATES) {
      const n = job.shards[s];
      if (!n) continue;
      const seg = el("span", { class: "seg-" + s });
      seg.style.flexGrow = String(n);
      segments.append(seg);
    }
    const running = job.state === "running";
    const labels = running || job.state === "paused" ? STATE_LABELS : ENDED_LABELS;
    const legend = el("div", { class: "legend" }, ...STATES.map((s) =>
      el("span", { "data-shards-state": s, "data-count": job.shards[s] },
        el("span", { class: "swatch seg-" + s }), el("b", {}, int(job.shards[s])), " " + labels[s])));
    const approx = estimate !== null ? "~" : "";
    const eta = job.state === "succeeded" ? "done"
      : running ? (job.eta_s === null || job.eta_s === undefined ? "—" : approx + duration(job.eta_s)) : "—";
    const records = int(job.records_done) + " / " +
      (total !== null ? int(total) : estimate !== null ? "~" + int(estimate) + " (estimated from bytes)" : "?");
    const meta = [job.name && job.name !== job.id ? job.name : null, job.processor, int(job.shards_total) + (job.shards_total === 1 ? " shard" : " shards")]
      .filter(Boolean).join(" · ");
    const sched = job.schedule;
    const llm = job.report && job.report.llm;
    const leases = int(job.shards.leased) + (sched.max_workers === null ? "" : " / " + int(sched.max_workers));
    return el("article", {
      class: "job",
      "data-job-id": job.id,
      "data-state": job.state,
      "data-records-done": job.records_done,
      "data-records-total": total === null ? "" : total,
      "data-records-estimate": estimate === null ? "" : estimate,
      "data-shards-done": job.shards.done,
      "data-shards-total": job.shards_total,
      "data-percent": p === null ? "" : pctFixed(p),
      "data-priority": sched.priority,
      "data-queue": sched.queue,
      "data-pool": sched.pool,
      "data-weight": sched.weight,
      "data-waiting": sched.waiting || "",
    },
      el("div", { class: "job-head" },
        el("div", { class: "job-title" }, el("span", { class: "job-id" }, job.id), el("span", { class: "job-meta" }, meta)),
        el("span", { class: "pill", "data-state": job.state }, job.state)),
      el("div", { class: "progress" }, bar, el("div", { class: "pct", "data-role": "percent" }, (p === null ? "" : approx) + pctText(p))),
      el("div", { class: "stats" },
        stat("Records", records, null, { "data-role": "records" }),
        stat("Shards done", int(job.shards.done) + " / " + int(job.shards_total), null, { "data-role": "shards" }),
        stat("Rate", running ? rate(job.records_per_s) : "—", null, { "data-role": "rate" }),
        stat("ETA", eta, null, { "data-role": "eta" }),
        stat("Skipped", int(job.records_skipped), job.records_skipped ? "warn" : null),
        stat("Failed attempts", int(job.attempts_failed), job.attempts_failed ? "warn" : null),
        stat("Crashes", int(job.crashes || 0), job.crashes ? "warn" : null, { "data-role": "crashes" }),
        stat("Priority", String(sched.priority), null, { "data-role": "priority" }),
        stat("Queue", sched.queue, null, { "data-role": "queue" }),
        stat("Pool", sched.pool, null, { "data-role": "pool" }),
        stat("Weight", String(sched.weight), null, { "data-role": "weight" }),
        stat("Leases", leases, null, { "data-role": "leases" }),
        stat("Waiting", sched.waiting || "—", sched.waiting ? "warn" : null, { "data-role": "waiting" }),
        ...budgetStats(job),
        llm ? stat("Tokens in / out", tokens(llm.prompt_tokens_per_s) + " / " + tokens(llm.completion_tokens_per_s), null, { "data-role": "tokens" }) : null,
        llm ? stat("Prefix cache", pctFixed(llm.prefix_cache_hit_rate * 100) + "%", null, { "data-role": "prefix-cache" }) : null),
      el("div", { class: "shards" }, segments, legend),
      renderReport(job),
      job.reason ? el("p", { class: "reason" }, job.reason) : null,
      job.isolating ? el("p", { class: "reason", "data-role": "isolating" }, job.isolating) : null,
      job.budget && job.budget.deadline_risk && running
        ? el("p", { class: "reason", "data-role": "deadline-risk" }, "Deadline at risk: " + job.budget.deadline_risk) : null,
      renderEvents(job),
      renderErrors(job));
  }

  function money(x) {
    return x === null || x === undefined ? "—" : x.toFixed(2);
  }

  // "06:00 UTC" within a day, else "2026-12-01 06:00 UTC".
  function deadlineWords(rfc3339) {
    const t = Date.parse(rfc3339);
    if (Number.isNaN(t)) return rfc3339;
    const iso = new Date(t).toISOString();
    const time = iso.slice(11, 16) + " UTC";
    return Math.abs(t - Date.now()) < 86400000 ? time : iso.slice(0, 10) + " " + time;
  }

  // Cost so far (of its cap), the cost at the end, the deadline and the
  // slack to it, and the workers that make it: as `stoke status` says.
  function budgetStats(job) {
    const b = job.budget;
    if (!b) return [];
    const running = job.state === "running";
    const out = [];
    if (b.cost_so_far !== null && b.cost_so_far !== undefined) {
      const of = b.max_cost === null || b.max_cost === undefined ? "" : " of " + money(b.max_cost);
      const near = b.max_cost ? b.cost_so_far >= 0.9 * b.max_cost : false;
      out.push(stat("Cost", money(b.cost_so_far) + of, near ? "warn" : null, { "data-role": "cost" }));
      if (running) out.push(stat("Cost at end", b.cost_forecast === null ? "no forecast yet" : money(b.cost_forecast), null, { "data-role": "cost-forecast" }));
    }
    if (b.finish_by) {
      let slack = "";
      if (running && b.deadline_slack_s !== null && b.deadline_slack_s !== undefined) {
        slack = b.deadline_slack_s >= 0 ? " · on track, " + duration(b.deadline_slack_s) + " spare"
          : " · late by " + duration(-b.deadline_slack_s);
      }
      const late = running && (b.deadline_risk || (b.deadline_slack_s !== null && b.deadline_slack_s < 0));
      out.push(stat("Deadline", deadlineWords(b.finish_by) + slack, late ? "warn" : null, { "data-role": "deadline" }));
      if (running && b.workers_wanted !== null && b.workers_wanted !== undefined) {
        const eta = b.eta_wanted_s === null || b.eta_wanted_s === undefined ? "" : " · done in " + duration(b.eta_wanted_s);
        out.push(stat("Workers to finish by it", int(b.workers_wanted) + eta, null, { "data-role": "workers-wanted" }));
      }
    }
    return out;
  }

  function renderEvents(job) {
    const events = job.events || [];
    if (!events.length) return null;
    const items = events.map((e) => el("li", {}, el("span", { class: "muted" }, clock(e.at_ms) + " "), e.message));
    return details("events:" + job.id, true, "Events (" + events.length + ")", el("ul", { "data-role": "events" }, ...items));
  }

  // Where the job's processor time went: one stacked bar, a segment per
  // cause, and the seconds and shares beside it.
  function renderReport(job) {
    const r = job.report;
    if (!r) return null;
    const total = CAUSES.reduce((n, [key]) => n + (r.seconds[key] || 0), 0);
    if (!total) return el("p", { class: "note", "data-role": "report" }, "Processor time: not reported yet");
    const bar = el("div", { class: "causebar", role: "img", "aria-label": "processor time by cause" });
    for (const [key, label, cls] of CAUSES) {
      const s = r.seconds[key] || 0;
      if (!s) continue;
      const seg = el("span", { class: cls, title: label + " " + s.toFixed(1) + " s", "data-cause": key });
      seg.style.flexGrow = String(s);
      bar.append(seg);
    }
    const legend = el("div", { class: "legend" }, ...CAUSES.filter(([key]) => r.seconds[key]).map(([key, label, cls]) =>
      el("span", { "data-cause": key },
        el("span", { class: "swatch " + cls }), el("b", {}, r.seconds[key].toFixed(1) + " s"),
        " " + label + " (" + Math.round((100 * r.seconds[key]) / total) + "%)")));
    const backups = r.backups ? " · " + int(r.backups) + " backups (" + int(r.backups_won || 0) + " won)" : "";
    const busy = "model busy " + Math.round(100 * r.busy_fraction) + "% · " + int(r.shards_split) + " shards split" + backups;
    return el("div", { class: "report", "data-role": "report" },
      el("div", { class: "report-head" }, "Processor time by cause", el("span", { class: "muted" }, " · " + busy)),
      bar, legend);
  }

  function orderJobs(jobs) {
    // Unfinished first in submission order, then the finished, newest first.
    const active = jobs.filter((j) => j.state === "running" || j.state === "paused");
    const ended = jobs.filter((j) => !(j.state === "running" || j.state === "paused")).reverse();
    return active.concat(ended);
  }

  function renderStages(stages) {
    const total = STAGES.reduce((n, [key]) => n + stages[key], 0);
    if (!total) return el("span", { class: "stage-text" }, "not reported yet");
    const bar = el("div", { class: "stagebar", "aria-hidden": "true" });
    for (const [key, , cls] of STAGES) {
      if (!stages[key]) continue;
      const seg = el("span", { class: cls });
      seg.style.flexGrow = String(stages[key]);
      bar.append(seg);
    }
    const text = STAGES.map(([key, label]) => label + " " + Math.round((100 * stages[key]) / total) + "%").join(" · ");
    return el("div", {}, bar, el("div", { class: "stage-text" }, text));
  }

  function renderWorkers(workers) {
    if (!workers.length) return el("p", { class: "empty" }, "No worker is connected.");
    return el("div", { class: "table-card" }, el("table", {},
      el("thead", {}, el("tr", {}, el("th", {}, "Worker"), el("th", {}, "Host"), el("th", {}, "Pool"), el("th", {}, "Devices"),
        el("th", {}, "Leases (job / shard)"), el("th", {}, "Processor time"), el("th", {}, "Batches"))),
      el("tbody", {}, ...workers.map((w) => el("tr", { class: "worker", "data-worker-id": w.worker_id, "data-pool": w.pool, "data-leases": w.leases.length },
        el("td", { class: "mono" }, w.worker_id),
        el("td", { class: "mono" }, w.host),
        el("td", { class: "mono" }, w.pool),
        el("td", { class: "mono" }, w.devices.join(", ") || "—"),
        el("td", {}, w.leases.length
          ? el("div", {}, ...w.leases.map((l) => el("span", { class: "chip", "data-job": l.job, "data-shard": l.shard }, l.job + " / " + l.shard)))
          : el("span", { class: "muted" }, "idle")),
        el("td", {}, renderStages(w.stages)),
        el("td", { class: "num" }, int(w.stages.batches)))))));
  }

  function render(data) {
    document.getElementById("summary").replaceChildren(...renderSummary(data));
    const jobs = document.getElementById("jobs");
    if (data.jobs.length) jobs.replaceChildren(...orderJobs(data.jobs).map(renderJob));
    else jobs.replaceChildren(el("p", { class: "empty" }, "No jobs yet. Submit one with stoke submit job.toml."));
    document.getElementById("workers").replaceChildren(renderWorkers(data.workers));
    const main = document.getElementById("status");
    main.setAttribute("data-loaded", "true");
    main.removeAttribute("data-stale");
    main.setAttribute("data-generated-ms", String(data.generated_ms));
  }

  function setLive(state, text) {
    const live = document.getElementById("live");
    live.setAttribute("data-live", state);
    document.getElementById("live-text").textContent = text;
  }

  function showFailure(err) {
    const why = err && err.message ? err.message : String(err);
    const banner = document.getElementById("banner");
    banner.hidden = false;
    if (lastData) {
      document.getElementById("status").setAttribute("data-stale", "true");
      banner.textContent = "Cannot reach the coordinator (" + why + "). Showing what it said at " +
        clock(lastOkAt) + "; retrying every " + POLL_MS / 1000 + " s.";
      setLive("error", "offline since " + clock(lastOkAt));
    } else {
      banner.textContent = "Cannot load " + API + " (" + why + "); retrying every " + POLL_MS / 1000 + " s.";
      setLive("error", "offline");
      for (const id of ["jobs", "workers"]) {
        document.getElementById(id).replaceChildren(el("p", { class: "empty" }, "No data yet."));
      }
    }
  }

  async function poll() {
    try {
      const response = await fetch(API, { cache: "no-store", headers: { Accept: "application/json" } });
      if (!response.ok) {
        let detail = "";
        try {
          const body = await response.json();
          detail = body && body.error ? ": " + body.error : "";
        } catch (_) {
          // not JSON: the status code says enough
        }
        throw new Error("HTTP " + response.status + detail);
      }
      const data = await response.json();
      render(data);
      lastData = data;
      lastOkAt = Date.now();
      document.getElementById("banner").hidden = true;
      setLive("ok", "live · updated " + clock(data.generated_ms));
    } catch (err) {
      showFailure(err);
    } finally {
      setTimeout(poll, POLL_MS);
    }
  }

  poll();
})();
