"""The one JSONL serving path: a ``specjax.jobs.Job`` served by the continuous-batching engine.

launch/batch.py and launch/generate.py's JSONL mode both end here, so a job's records, errors,
outputs and summary lines are the same whichever script serves it. The caller loads the model
and builds the backend and policy from its EngineSpec (specjax.registry); online distillation
hooks in through ``drafts`` (distill.routing.MultiDraft).

Input: one JSON object per line with a ``prompt`` (string), an optional ``id`` (a string or an
integer; default ``#<line number>``) and optional per-record overrides of the sampling flags
(``temperature``, ``top_k``, ``top_p``, ``seed``, ``max_new_tokens``). Output: exactly one line
per non-blank input line, {"id", "prompt", "output",
"output_ids", "num_prompt_tokens", "num_tokens", "finish_reason"}, or {"id", "error"} for a
line that is not valid UTF-8 or JSON, a bad or repeated id, a bad override, an empty prompt or a
prompt that does not fit the engine's KV slots (``--slots N``; with ``--slots 0``, the default,
the model's context: records are grouped by the slot bucket they need, smallest first, and each
group is served by a backend with rows of that size, so short records never reserve the longest
one's cache). None of these stops the job. The job
layer (``specjax.jobs``; README "JSONL jobs") holds the rules: ids, duplicates, resume, the lock
on the output, retries and exit statuses.

Every record arrives at t = 0 and the engine (``specjax.engine``) serves them with continuous
batching: the first ``max(--batch_buckets)`` run, the rest queue and are admitted as rows free
up. Each finished request is appended to ``--output_jsonl`` (flushed and fsynced) the moment it
finishes, so a killed job loses only its in-flight requests: run the same command again and it
skips every id already in the output (error records included; delete those lines to retry them).
Ctrl-C stops after the current engine step (exit status 130); the same command resumes.

Executables (every batch bucket x compiled K x the prompt buckets present, greedy and/or
sampled) compile when serving first reaches them, and ahead in a background thread what the job
is likely to reach next (JaxBackend.warmup, ``lazy``, ``whole_job``): the first bucket's work
first, a smaller bucket's once the draining batch would compact into it, a K bucket's steps once
SmartSpec wants that K (it joins the policy's options once compiled). A job reaching few of them
compiles few. The seconds serving waited for compilation are printed as compilation, not in the
reported tok/s (background compilation beside serving is). The executable cache (``$SPECJAX_CACHE_DIR``) holds
each one; a warm run loads only those it reaches, when it reaches them.
"""

from __future__ import annotations

import dataclasses
import sys
import time


def sampling_of(fields: dict):
    """SamplingParams of a record's checked request fields (results.request_fields)."""
    from specjax.sampling import SamplingParams

    return SamplingParams(temperature=fields["temperature"], top_k=fields["top_k"], top_p=fields["top_p"],
                          seed=fields["seed"])


def slot_classes(items, row_need, buckets) -> dict[int, list[int]]:
    """Indices of ``items`` (prepared Requests) by the smallest of the cache-slot ``buckets`` that
    holds ``row_need(request)`` slots (Scheduler.row_need: the engine's admission rule)."""
    from specjax import buckets as bk

    out: dict[int, list[int]] = {}
    for i, r in enumerate(items):
        out.setdefault(bk.pick(buckets, row_need(r), "KV slots"), []).append(i)
    return dict(sorted(out.items()))


def prefix_order(items, idx) -> list[int]:
    """``idx`` (indices of prepared Requests) with the records that share a prompt prefix next to
    each other, so that a prefix store serves them while it still holds that prefix (a job whose
    templates are interleaved would otherwise evict one for the other under a tight budget).
    Sorting the prompts' token bytes groups every shared prefix (memcmp order, not numeric: only
    adjacency matters); records with equal prompts keep their job order."""
    import numpy as np

    return sorted(idx, key=lambda i: np.asarray(items[i].prompt, np.int32).tobytes())


def serve_job(job, model, backend, policy, policy_label: str, *, drafter: str, chat: bool = False,
              system: str | None = None, ignore_eos: bool = False, prefill_budget: int | None = None,
              drafts=None, compile_ahead: bool = False, report: dict | None = None) -> int:
    """Serve every record of ``job`` at t = 0 on ``backend`` under ``policy``; each finished
    request is written the moment it finishes. ``backend``: a JaxBackend, or a function of a
    slot count returning one (KV rows sized from the job: the records in groups by the slot
    bucket they need, smallest first, each on a backend of that size made when its group is
    served and released after). Compiles what the records need when first reached
    and ahead in the background (``compile_ahead``: all of it before serving), timed apart. Prints the serving, latency and speculation summaries. Returns the job's exit status;
    ``report`` (a dict) gets the job's figures: tokens, serve_s, serve_cpu_s, compile_s, host_s
    (ServingEngine.host_s: the serving loop's wall seconds between device calls), mean_k."""
    from specjax.engine.loop import ServingEngine, summarize
    from specjax.engine.scheduler import Request, Scheduler
    from specjax.errors import SpecjaxError
    from specjax.generate import validate_request
    from specjax.goodput import DraftPrefillGate, GoodputPolicy
    from specjax import registry
    from specjax.registry import format_spec_stats
    from specjax.spec_generate import SpecStats

    from specjax import buckets as bk

    tok = model.tokenizer
    if chat:
        tok.encode_chat("hi", system)  # a model without a chat template fails here, not on every record
    gate = DraftPrefillGate() if isinstance(policy, GoodputPolicy) else None
    make = backend if callable(backend) else None  # KV rows sized from the job (slot classes)
    # (classes from 512 slots: the engine's long-standing default row)
    buckets = tuple(b for b in bk.context_slot_buckets(model.cfg.max_position) if b >= 512) or (model.cfg.max_position,)
    if make is not None:
        backend = make(buckets[0])  # (the smallest class's; its rows and K stand for every class's)
    # the engine's admission rule (with slot classes: the largest class's)
    sched = Scheduler(backend.num_rows, backend.slots if make is None else buckets[-1], backend.k_max + 1)
    check = sched.check

    def prepare(rec):
        ids = tok.encode_chat(rec.prompt, system) if chat else tok.encode(rec.prompt)
        f = rec.fields
        validate_request(ids, f["max_new_tokens"], model.cfg)
        req = Request("r", ids, f["max_new_tokens"], sampling_of(f), arrival=0.0, ignore_eos=ignore_eos,
                      tag=f["tag"])
        try:
            check(req)
        except SpecjaxError as e:  # (the job layer names the line; the engine's request id means nothing here)
            raise SpecjaxError(str(e).removeprefix("request r: ")) from None
        return req

    warmed: dict = {}  # slots -> the (prompt length, greedy) shapes its backend compiled for
    backends: dict = {backend.slots: backend}  # every backend made (their summaries)
    served: set = set()  # the slot classes served
    runs = []  # (engine, outputs) of every engine run (one per slot class, unless a failure was retried)
    t = dict(compile=0.0, serve=0.0, serve_cpu=0.0)  # serve_cpu: this process's CPU seconds (all threads)
    stats = SpecStats()

    def serve_class(be, job_items, idx, emit):
        # (with a prefix store: records sharing a prefix one after another, while it holds it)
        idx = prefix_order(job_items, idx) if be.prefix is not None else idx
        items = [job_items[i] for i in idx]
        shapes = {(len(r.prompt), r.sampling.greedy) for r in items} - warmed.setdefault(be.slots, set())
        if shapes:  # what this run may need (a retry needs nothing new)
            t0 = time.perf_counter()
            be.warmup(prompt_lens=sorted({n for n, _ in shapes}),
                      greedy_modes=tuple(sorted({g for _, g in shapes}, reverse=True)), progress=True,
                      lazy=lazy, queue=[len(r.prompt) for r in items], later_ks=later_ks, execute=run_once,
                      whole_job=True, demand_ks=policy.plans_coming)
            # (and the drafter's host kernels: the first drafts would wait for them)
            kernels = run_once and registry.warm_host_kernels(drafter)
            t["compile"] += time.perf_counter() - t0
            warmed[be.slots].update(shapes)
            how = (f"compiling on first use, {be.planner.later_planned} executables ahead in the background"
                   + (f" and {be.planner.on_demand_planned} if serving reaches them" if be.planner.on_demand_planned else "")
                   if lazy else f"compiled {len(be.table)} executables{' and ran each once' if run_once else ''}"
                   f"{', warmed the drafter host kernels,' if kernels else ''} in {t['compile']:.1f} s")
            job.note(f"[{how}; serving {len(items)} requests, policy {policy_label}, drafter {drafter}, "
                     f"{be.num_rows} KV rows x {be.slots} slots]")

        def on_finish(o):
            i = idx[int(o.id)]
            if o.error is not None:
                emit(i, error=o.error)
            else:
                emit(i, result={"output": tok.decode(o.tokens), "output_ids": [int(x) for x in o.tokens],
                                "num_prompt_tokens": o.prompt_len, "num_tokens": len(o.tokens),
                                "finish_reason": o.finish_reason})
            if drafts is not None:  # after the record is on disk: an update never delays a result
                drafts.on_finish(o)

        be.reset()  # a fresh live state (also after a failed run)
        reqs = [dataclasses.replace(r, id=str(i)) for i, r in enumerate(items)]
        if drafts is not None:
            drafts.expect(reqs)
        engine = ServingEngine(be, policy, eos_ids=tok.eos_ids, on_finish=on_finish,
                               prefill_gate=gate if be.drafter.gates_prefill else None, prefill_budget=prefill_budget, should_stop=job.should_stop,
                               on_step=None if drafts is None else drafts.on_step, drafts=drafts)
        # (serving CPU: this process's, less what compilations took meanwhile, in the background or
        # waited for: a lazily compiled job's serving costs what an ahead-compiled one's does)
        def compile_cpu():
            return be.table.ahead_cpu_s + be.table.late_cpu_s

        t0, c0, k0 = time.perf_counter(), time.process_time(), compile_cpu()
        try:
            outputs = engine.run(reqs)
            runs.append((engine, outputs))
            stats.merge(engine.counts)
        finally:
            t["serve"] += time.perf_counter() - t0
            t["serve_cpu"] += time.process_time() - c0 - (compile_cpu() - k0)

    def generate(items, emit):
        if make is None:
            return serve_class(backend, items, list(range(len(items))), emit)
        store = None  # one prefix store for every class: a long prompt reuses a shorter one's chunks
        for S, idx in slot_classes(items, sched.row_need, buckets).items():
            be = backends.get(S) or backends.setdefault(S, make(S))
            if store is not None and be.prefix is not None:
                be.share_prefix(store)
            store = be.prefix
            served.add(S)
            try:
                serve_class(be, items, idx, emit)
            finally:
                # this class's cache and executables go (their memory maps are what a process
                # runs out of); its counts stay for the summary
                be.stop_later()
                be.reset()
                be.table.release()
                warmed.pop(S, None)
            if job.should_stop():
                break
        if store is not None:
            store.clear()

    wall0 = time.perf_counter()
    # Executables compile when serving first reaches them, the rest ahead in the background (a
    # warm cache: loaded on first use), except where a draft-ahead path needs them all up front
    # and on a mesh (sharded executables are compiled up front, as measured so far).
    lazy = not (compile_ahead or backend.options.draft_first) and backend.layout is None
    # SmartSpec's K buckets join its options once compiled; a fixed K is needed from the first step
    later_ks = [k for k in backend.k_buckets if k != getattr(policy, "k", None)] if lazy else ()
    # --compile ahead also runs each executable once on empty rows: a step's first run costs
    # 0.1-0.4 s more than later ones (code pages, buffers), which a job whose drafter verifies on
    # a few percent of its steps had paid in serving (a suffix job: 0.94x AR -> 1.00x on 48
    # records). (Not on a mesh: its executables are compiled up front, not run.)
    run_once = compile_ahead and backend.layout is None
    try:
        code = job.serve(prepare, generate)
    finally:
        left = sorted({k for be in backends.values() for k in be.stop_later()})  # (in progress: finished, on disk)
    tables = [be.table for be in backends.values()]
    waited = sum(tb.late_s for tb in tables) if lazy else 0.0  # serving stalled on these compilations (or loads)
    t["compile"] += waited
    t["serve"] -= waited
    outputs = [o for _, outs in runs for o in outs]
    n_tok = sum(len(o.tokens) for o in outputs if o.error is None)
    # (CPU ms per token: what other processes on a shared machine change least; a drafter's host work shows there)
    print(f"{n_tok} tokens in {t['serve']:.1f} s serving = {n_tok / max(t['serve'], 1e-9):.1f} tok/s "
          f"(+ {t['compile']:.1f} s compilation; {time.perf_counter() - wall0:.1f} s for the job; serving CPU "
          f"{1e3 * t['serve_cpu'] / max(n_tok, 1):.2f} ms/token)", file=sys.stderr)
    if lazy:
        print(f"compilation: {sum(tb.late for tb in tables)} executables compiled or loaded when first reached "
              f"({waited:.1f} s waited), {sum(tb.ahead for tb in tables)} in the background beside serving "
              f"({sum(tb.ahead_s for tb in tables):.1f} s)"
              + (f"; steps of K {left} not compiled at every batch bucket by the end" if left else ""),
              file=sys.stderr)
    if make is not None:
        print(f"KV rows sized from the job: {len(served)} slot class{'es' if len(served) != 1 else ''} served "
              f"({', '.join(map(str, sorted(served)))} slots per row)", file=sys.stderr)
    prefix = [st.stats for st in {id(be.prefix): be.prefix for be in backends.values() if be.prefix is not None}.values()
              if st.stats.lookups]  # (each store once: slot classes share one)
    if prefix:
        from specjax.engine.prefix_store import PrefixStats

        print(PrefixStats(*(sum(getattr(p, f.name) for p in prefix) for f in dataclasses.fields(PrefixStats))).line(),
              file=sys.stderr)
    s = summarize(outputs, [st for eng, _ in runs for st in eng.steps]) if outputs else None
    if report is not None:
        report.update(tokens=n_tok, serve_s=t["serve"], serve_cpu_s=t["serve_cpu"], compile_s=t["compile"],
                      host_s=sum(eng.host_s for eng, _ in runs), mean_k=s["mean_k"] if s and s["requests"] - s["errors"] else None)
    if s and s["requests"] - s["errors"]:
        print(f"latency mean {s['mean_latency_s']:.2f} s, p90 {s['p90_latency_s']:.2f} s (queueing included); "
              f"mean K {s['mean_k']:.2f}; mean batch {s['mean_batch']:.2f} over {s['steps']} steps; policy "
              f"{policy_label}", file=sys.stderr)
        if backend.k_max:
            print(f"spec {drafter}, policy {policy_label}: {format_spec_stats(stats)}", file=sys.stderr)
    return code
