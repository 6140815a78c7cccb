"""Warm-up left for idle time (kernels, decode shapes, prompt piece lengths): one item per idle
turn of the worker; a failure is logged and leaves the rest to traffic (they compile when first
used) instead of ending the worker."""

from __future__ import annotations

import logging
from types import SimpleNamespace


class _Model:
    """Kernels and attention plans left to build: each build appends its name to `log`."""

    def __init__(self, kernels, log, fail=(), plans=(), idle=()):
        self.kernels, self.log, self.fail, self.plans = list(kernels), log, fail, list(plans)
        self.idle = list(idle)

    def idle_warmups_pending(self):
        return len(self.idle)

    def warm_next_idle(self):
        name = self.idle.pop(0)
        if name in self.fail:
            raise RuntimeError(f"{name} ran out of memory")
        self.log.append(name)

    def attention_plans_pending(self):
        return len(self.plans)

    def build_next_attention_plan(self, hot=False):
        name = self.plans.pop(0)
        if name in self.fail:
            raise RuntimeError(f"cuDNN refused {name}")
        self.log.append(name)

    def kernels_pending(self):
        return len(self.kernels)

    def build_next_kernel(self):
        name = self.kernels.pop(0)
        if name in self.fail:
            raise RuntimeError(f"nvrtc refused {name}")
        self.log.append(name)


def _core(warm_shape, kernels=(), log=None, fail=(), lengths=(), warm_length=None, plans=(), idle=()):
    from vlmserve.engine.core import EngineCore

    log = [] if log is None else log
    core = SimpleNamespace(
        _shapes_to_warm=[(1, 32), (2, 32), (4, 32)],
        _lengths_to_warm=list(lengths),
        _filler_token=7,
        runner=SimpleNamespace(
            batches=SimpleNamespace(
                warm_shape=warm_shape, retrace=lambda: log.append("retrace"), other_kv_dtypes=lambda: []
            ),
            grammars_pending=lambda: False,
            warm_piece_length=warm_length or (lambda length, filler: log.append(("piece", length, filler))),
        ),
        model=_Model(kernels, log, fail, plans, idle),
        noted=[],
        _kernel_seconds=0.0,
        kernel_builds=None,
        rehearsal=None,
        warm_up_due=False,
        _warm_shapes=[],
        _shape_logged=0.0,
        _kernels_filed=False,
        _warmed=True,
    )
    core._note_peak = core.noted.append
    core.has_work = lambda: False
    core._idle_since = None
    core.forget_prefixes = lambda: log.append("prefixes forgotten")
    core.sched = SimpleNamespace(prefilling=[], running=[], preempted=[])
    core._kernels_replaced = lambda: EngineCore._kernels_replaced(core)
    core._build_kernel = lambda: EngineCore._build_kernel(core)
    core._built_kernels_ready = lambda: EngineCore._built_kernels_ready(core)
    core._warm_next_shape = lambda: EngineCore._warm_next_shape(core)
    core._take_built_kernels = lambda: EngineCore._take_built_kernels(core)
    core._warm_piece_length = lambda: EngineCore._warm_piece_length(core)
    core._build_attention_plan = lambda: EngineCore._build_attention_plan(core)
    core._queue_decode_builds = lambda rows: EngineCore._queue_decode_builds(core, rows)
    core._warm_wider_rows = lambda rows: EngineCore._warm_wider_rows(core, rows)
    core._await_side_builds = lambda: EngineCore._await_side_builds(core)
    core._warm_capacity = lambda: EngineCore._warm_capacity(core)
    core._idle_capacity = lambda: EngineCore._idle_capacity(core)
    core._grammars_due = lambda: EngineCore._grammars_due(core)
    core._idle_warmups_due = lambda: EngineCore._idle_warmups_due(core)
    core._warm_next_idle = lambda: EngineCore._warm_next_idle(core)
    core._rehearsal_ended = lambda: EngineCore._rehearsal_ended(core)
    return core, EngineCore


def test_one_shape_per_idle_turn():
    traced = []
    core, engine_core = _core(lambda rows, width: traced.append((rows, width)) or True)
    while engine_core.has_idle_work(core):
        engine_core.idle_work(core)
    assert traced == [(1, 32), (2, 32), (4, 32)] and len(core.noted) == 3


def test_a_failed_compile_leaves_the_rest_to_traffic(caplog):
    def fails(rows, width):
        raise MemoryError("out of device memory")

    core, engine_core = _core(fails)
    with caplog.at_level(logging.WARNING):
        engine_core.idle_work(core)  # does not raise
    assert not engine_core.has_idle_work(core)
    assert "compile when first used" in caplog.text


def test_kernels_are_built_first_then_decode_steps_retrace_with_them_then_shapes_compile_then_pieces_run():
    log = []
    core, engine_core = _core(
        lambda rows, width: log.append((rows, width)) or True, ["qkv", "mlp"], log, lengths=[640, 768]
    )
    while engine_core.has_idle_work(core):
        engine_core.idle_work(core)
    assert log == ["qkv", "mlp", "retrace", (1, 32), (2, 32), (4, 32), ("piece", 640, 7), ("piece", 768, 7)]


def test_attention_plans_traffic_brought_are_built_after_the_decode_shapes_and_before_the_piece_lengths(caplog):
    """A plan that fails is logged and skipped (its shape keeps the plan-free kernel); the rest go on."""
    log = []
    core, engine_core = _core(
        lambda rows, width: log.append((rows, width)) or True,
        log=log,
        lengths=[640],
        plans=["plan-a", "plan-b", "plan-c"],
        fail=("plan-b",),
    )
    with caplog.at_level(logging.WARNING):
        while engine_core.has_idle_work(core):
            engine_core.idle_work(core)
    assert log == [(1, 32), (2, 32), (4, 32), "plan-a", "plan-c", ("piece", 640, 7)]
    assert "cuDNN refused plan-b" in caplog.text


def test_the_models_idle_warmups_run_last_one_a_turn_and_a_failed_one_is_skipped(caplog):
    """The model's own shapes for idle time (the Qwen2-VL tower's row buckets on CUDA) run after
    the piece lengths, one per idle turn, counted as warm-up left meanwhile; one that fails is
    logged and the rest go on."""
    log = []
    idle = ["rows-512", "rows-1024", "rows-1536"]
    core, engine_core = _core(lambda rows, width: True, log=log, lengths=[640], idle=idle, fail=("rows-1024",))
    core._shapes_to_warm = []
    pending = []
    with caplog.at_level(logging.WARNING):
        while engine_core.has_idle_work(core):
            pending.append(engine_core._idle_warmups_due(core))
            engine_core.idle_work(core)
    assert log == [("piece", 640, 7), "rows-512", "rows-1536"]
    assert pending == [3, 3, 2, 1] and "rows-1024 ran out of memory" in caplog.text


def test_a_slow_piece_leaves_the_longer_ones_to_traffic(monkeypatch, caplog):
    from vlmserve.engine import core as engine_module

    monkeypatch.setattr(engine_module, "IDLE_PIECE_MAX_S", 0.0)  # every piece counts as slow
    ran = []
    core, engine_core = _core(lambda rows, width: True, lengths=[640, 768, 896], warm_length=lambda n, f: ran.append(n))
    core._shapes_to_warm = []
    with caplog.at_level(logging.INFO):
        engine_core.idle_work(core)
    assert ran == [640] and not engine_core.has_idle_work(core)
    assert "longer ones are not run while idle" in caplog.text


def test_a_failed_piece_leaves_the_rest_to_traffic(caplog):
    def fails(length, filler):
        raise MemoryError("out of device memory")

    core, engine_core = _core(lambda rows, width: True, lengths=[640, 768], warm_length=fails)
    core._shapes_to_warm = []
    with caplog.at_level(logging.WARNING):
        engine_core.idle_work(core)  # does not raise
    assert not engine_core.has_idle_work(core) and "piece lengths while idle failed" in caplog.text


def test_a_kernel_that_fails_to_build_is_skipped_and_the_rest_go_on(caplog):
    log = []
    core, engine_core = _core(lambda rows, width: True, ["qkv", "mlp"], log, fail=("qkv",))
    with caplog.at_level(logging.WARNING):
        engine_core.idle_work(core)
        engine_core.idle_work(core)
    assert log == ["mlp", "retrace"] and "nvrtc refused qkv" in caplog.text


class _Background:
    """kernel_prebuild.Background's stand-in: settings whose builds have ended, taken in order
    (None: that one failed and stays dequantized)."""

    def __init__(self, ended, log):
        self.ended, self.log = list(ended), log

    def pending(self):
        return len(self.ended)

    def ready(self):
        return bool(self.ended)

    def take_one(self):
        setting = self.ended.pop(0)
        self.log.append(("took", setting))
        return None if setting is None else (setting, "bfloat16")


def test_kernels_side_processes_built_are_taken_first_and_their_layers_leave_the_dequantized_path():
    """A setting taken is released (its layers take MLX's kernels again), and the compiled decode
    step traces again: the warm shapes while idle, since a trace keeps the path it took."""
    from vlmserve.engine.ops import many_row_dequantized

    log = []
    core, engine_core = _core(lambda rows, width: log.append(("shape", rows)) or True, kernels=["k"], log=log)
    core._shapes_to_warm, core._warm_shapes = [], [(1, 32), (2, 32)]
    core.kernel_builds = _Background([(4, 64), None], log)
    row = SimpleNamespace(kv_reusable=True)
    core.sched.running.append(row)
    many_row_dequantized.hold({(4, 64), (8, 64)})
    try:
        engine_core.idle_work(core)
        assert not row.kv_reusable  # its KV came from the dequantized path: never cached for others
        # KV cached from the dequantized path is dropped: a cache never changes an output.
        assert log == [("took", (4, 64)), "retrace", "prefixes forgotten"]
        assert many_row_dequantized.held() == {(8, 64)}
        assert core._shapes_to_warm == [(1, 32), (2, 32)]
        engine_core.idle_work(core)  # a failed setting stays held: nothing to trace again
        assert log[3:] == [("took", None)] and many_row_dequantized.held() == {(8, 64)}
        assert core.kernel_builds is None  # all taken
        while engine_core.has_idle_work(core):
            engine_core.idle_work(core)
        assert log[4:] == ["k", "retrace", ("shape", 1), ("shape", 2)]  # then the model's own kernels
    finally:
        many_row_dequantized.reset()


def test_warm_up_checks_the_decode_kernels_then_compiles_every_warm_shape_with_their_builds_filed_first(monkeypatch):
    """Before ready: the builds queued at load are filed, then the kernels are checked (reading
    them), then each warm shape is traced unrun (queueing its builds), those are filed, and only
    then is each shape compiled."""
    from vlmserve.engine.ops import kernel_disk_cache

    log = []
    core, engine_core = _core(lambda rows, width: log.append(("compile", rows)) or True, ["qkv", "mlp"], log)
    core._shapes_to_warm = []
    core.runner.batches.shapes_to_warm = lambda rows, capacity: [(n, 32) for n in (1, 2, 4) if n <= rows]
    core.runner.batches.note_builds = lambda rows, width: log.append(("note", rows))
    core.info = SimpleNamespace(context_length=4096)
    core.sched = SimpleNamespace(prefill_chunk=512)
    monkeypatch.setattr(kernel_disk_cache, "filer", lambda: SimpleNamespace(flush=lambda: log.append("flush")))
    engine_core._warm_decode(core, 2)
    assert log == ["flush", "qkv", "mlp", "retrace", ("note", 1), ("note", 2), "flush", ("compile", 1), ("compile", 2)]
    assert core._shapes_to_warm == [] and core._warm_shapes == [(1, 32), (2, 32)]
    assert not engine_core.has_idle_work(core)


def test_decode_shapes_past_the_warm_rows_are_compiled_while_idle_and_again_after_a_kernel_swap(monkeypatch):
    """Warm-up's bound (its row count) leaves the bigger row buckets up to --max-num-seqs to
    idle time, instead of to a full batch's second step; a kernel swap queues them again."""
    from vlmserve.engine.ops import kernel_disk_cache

    log = []
    core, engine_core = _core(lambda rows, width: log.append(("compile", rows)) or True, [], log)
    core._shapes_to_warm = []
    core.runner.batches.shapes_to_warm = lambda rows, capacity: [(n, 32) for n in (1, 2, 4, 8) if n <= rows]
    core.runner.batches.note_builds = lambda rows, width: None
    core.info = SimpleNamespace(context_length=4096)
    core.sched = SimpleNamespace(prefill_chunk=512, prefilling=[], running=[], preempted=[])
    monkeypatch.setattr(kernel_disk_cache, "filer", lambda: None)
    engine_core._warm_decode(core, 2, later_rows=8)
    assert log == [("compile", 1), ("compile", 2)]
    assert core._shapes_to_warm == [(4, 32), (8, 32)] and engine_core.has_idle_work(core)
    while engine_core.has_idle_work(core):
        engine_core.idle_work(core)
    assert log[2:] == [("compile", 4), ("compile", 8)]
    engine_core._kernels_replaced(core)
    assert core._shapes_to_warm == [(1, 32), (2, 32), (4, 32), (8, 32)]


def test_where_attention_gathers_idle_time_also_compiles_the_widths_of_longer_rows(monkeypatch):
    """Where the step's shape depends on its longest row (no kernel reads the pool: Metal), warm-up
    compiles the widths of two prefill chunks and idle time those of rows up to
    IDLE_WIDTH_TOKENS positions (or the context, if shorter), at every row bucket."""
    from vlmserve.engine.core import IDLE_WIDTH_TOKENS
    from vlmserve.engine.ops import kernel_disk_cache

    log = []
    core, engine_core = _core(lambda rows, width: log.append((rows, width)) or True, [], log)
    core._shapes_to_warm = []

    def shapes_to_warm(rows, capacity):  # a table width per 256 positions, as a gathering step's
        return [(n, w) for n in (1, 2, 4, 8) if n <= rows for w in (256, 512, 1024, 2048, 4096, 8192) if w <= capacity]

    core.runner.batches.shapes_to_warm = shapes_to_warm
    core.runner.batches.note_builds = lambda rows, width: None
    core.sched = SimpleNamespace(prefill_chunk=512, prefilling=[], running=[], preempted=[])
    monkeypatch.setattr(kernel_disk_cache, "filer", lambda: None)
    for context, widest in ((32768, IDLE_WIDTH_TOKENS), (4096, 4096)):
        log.clear()
        core.info = SimpleNamespace(context_length=context)
        engine_core._warm_decode(core, 2, later_rows=4)
        assert log == [(n, w) for n in (1, 2) for w in (256, 512, 1024)]  # warm-up: two chunks
        while engine_core.has_idle_work(core):
            engine_core.idle_work(core)
        idle = log[6:]
        assert sorted(idle) == sorted({s for s in shapes_to_warm(4, widest)} - set(log[:6]))
        assert max(w for _, w in idle) == widest and max(n for n, _ in idle) == 4


def test_warm_up_queues_the_decode_steps_builds_before_its_first_generation_then_drops_those_traces(monkeypatch):
    """The decode step's builds are queued (traced unrun) before the generations, so side
    processes compile them meanwhile; those traces are dropped before anything runs, since the
    decode kernels' checks may still change what the step launches."""
    import numpy as np

    from vlmserve.engine.ops import kernel_disk_cache
    from vlmserve.protocol import PreparedRequest

    log = []
    core, engine_core = _core(lambda rows, width: True, [], log)
    core.runner.batches.shapes_to_warm = lambda rows, capacity: [(n, 32) for n in (1, 2, 4) if n <= rows]
    core.runner.batches.note_builds = lambda rows, width: log.append(("note", rows))
    core.info = SimpleNamespace(context_length=4096)
    core.sched = SimpleNamespace(prefill_chunk=512, prefill_bucket=0, max_num_seqs=40, lone_takes_budget=True)
    core.forget_prefixes = lambda: None
    core._generate_alone = lambda name, prepared: log.append(("generate", name))
    core._step_memory = None
    core._warm_decode = lambda rows, later_rows: log.append(("warm decode", rows, later_rows))
    core.model.prefills_pieces = False
    core.note_decode_builds = lambda: engine_core.note_decode_builds(core)
    core._decode_builds_noted = False
    filer = SimpleNamespace(
        found=0,
        queued=0,
        hurry=lambda: log.append("file now"),
        await_soon=lambda timeout: log.append("await") or (0, 0),
    )
    monkeypatch.setattr(kernel_disk_cache, "filer", lambda: filer)
    engine_core.warm_up(core, [PreparedRequest(prompt_ids=np.arange(5, dtype=np.int32))])
    # Warm-up traces up to WARM_SLOTS rows before ready; idle time, the rows up to --max-num-seqs.
    assert log == [
        ("note", 1),
        ("note", 2),
        ("note", 4),
        "retrace",
        "file now",
        "await",  # the builds side processes compile, before the first generation would compile them here
        ("generate", "warmup-0"),
        ("warm decode", 32, 40),
    ]

    log.clear()  # queued at load already (the engine does it as its load ends): not again
    engine_core.warm_up(core, [PreparedRequest(prompt_ids=np.arange(5, dtype=np.int32))])
    assert log == ["await", ("generate", "warmup-0"), ("warm decode", 32, 40)]

    log.clear()  # where builds are not filed, nothing is traced ahead
    core._decode_builds_noted = False
    monkeypatch.setattr(kernel_disk_cache, "filer", lambda: None)
    engine_core.warm_up(core, [PreparedRequest(prompt_ids=np.arange(5, dtype=np.int32))])
    assert log == [("generate", "warmup-0"), ("warm decode", 32, 40)]


def test_the_structured_output_tokenizer_is_built_last_while_idle():
    """After every other piece of idle warm-up, the structured-output tokenizer is built once,
    so the first request with a response_format does not build it while every stream waits."""
    log = []
    core, engine_core = _core(lambda rows, width: log.append(("shape", rows)) or True, lengths=[640])
    core._shapes_to_warm = [(1, 32)]
    built = []
    core.runner.grammars_pending = lambda: not built
    core.runner.prepare_grammars = lambda: built.append(True) or log.append("grammars")
    core.runner.warm_piece_length = lambda length, filler: log.append(("piece", length))
    core._warmed = False  # before warm-up ends, the worker is the warm-up's
    while engine_core.has_idle_work(core):
        engine_core.idle_work(core)
    assert log == [("shape", 1), ("piece", 640)] and engine_core._grammars_due(core) is False
    core._warmed = True
    turns = 0
    while engine_core.has_idle_work(core):
        engine_core.idle_work(core)
        turns += 1
    assert log == [("shape", 1), ("piece", 640), "grammars"] and turns == 1


def test_preparing_the_grammars_builds_the_tokenizer_once_and_a_failure_is_left_to_requests(caplog):
    from vlmserve.engine.runner.model_runner import ModelRunner

    calls = []

    def build(fail):
        def grammars():
            calls.append(fail)
            if fail:
                raise ValueError("this tokenizer cannot be converted")
            runner._grammar_factory = "factory"

        return grammars

    runner = SimpleNamespace(_grammar_factory=None, _grammar_tried=False)
    runner._grammars = build(fail=False)
    assert ModelRunner.grammars_pending(runner)
    ModelRunner.prepare_grammars(runner)
    assert runner._grammar_factory == "factory" and not ModelRunner.grammars_pending(runner)

    runner = SimpleNamespace(_grammar_factory=None, _grammar_tried=False)
    runner._grammars = build(fail=True)
    with caplog.at_level(logging.WARNING):
        ModelRunner.prepare_grammars(runner)
    assert not ModelRunner.grammars_pending(runner)  # not tried again while idle
    assert "could not build the structured-output tokenizer" in caplog.text and calls == [False, True]


def test_warm_up_is_pending_while_side_processes_file_this_starts_kernels(monkeypatch):
    """`warmup_pending` counts 1 while MLX's indexing builds or compile rehearsal run, or
    vlmserve's kernel builds are queued or being filed: at 0 the kernel cache holds what this
    start built."""
    from vlmserve.engine.core import EngineCore
    from vlmserve.engine.ops import kernel_disk_cache

    filer = SimpleNamespace(busy=lambda: False)
    monkeypatch.setattr(kernel_disk_cache, "filer", lambda: filer)
    core = SimpleNamespace(indexing_builds=SimpleNamespace(running=lambda: True), rehearsal=None)
    seen = [EngineCore._kernels_filing(core)]
    core.indexing_builds = SimpleNamespace(running=lambda: False)
    seen.append(EngineCore._kernels_filing(core))
    filer.busy = lambda: True
    seen.append(EngineCore._kernels_filing(core))
    monkeypatch.setattr(kernel_disk_cache, "filer", lambda: None)
    core.indexing_builds = None
    seen.append(EngineCore._kernels_filing(core))
    core.rehearsal = object()  # the engine switches to compiled kernels when it ends
    seen.append(EngineCore._kernels_filing(core))
    assert seen == [1, 0, 1, 0, 1]


def test_idle_work_waits_for_the_warm_up_on_its_way():
    """Idle work starts by waiting for the kernel builds queued at load; a warm-up on its way
    need not wait for them, so until it has run the worker takes it at once."""
    core, engine_core = _core(lambda rows, width: True, kernels=["decode attention"])
    core.warm_up_due = True
    assert not engine_core.has_idle_work(core)
    core.warm_up_due = False
    assert engine_core.has_idle_work(core)


def test_decode_shapes_of_another_kv_dtype_warm_up_met_are_compiled_while_idle(monkeypatch):
    """Rows whose prompts embed wider than the model (float32 image embeddings in a bfloat16
    model) decode on a pool of their own: its shapes, up to --max-num-seqs rows, are left to idle
    time (the compile rehearsal traces them at once) and queued again after a kernel swap."""
    from vlmserve.engine.ops import kernel_disk_cache

    log = []
    core, engine_core = _core(lambda rows, width, *dtype: log.append(("compile", rows, *dtype)) or True, [], log)
    core._shapes_to_warm = []
    widths = {None: 32, "f32": 16}
    core.runner.batches.shapes_to_warm = lambda rows, capacity, dtype=None: [
        (n, widths[dtype]) for n in (1, 2, 4) if n <= rows
    ]
    core.runner.batches.other_kv_dtypes = lambda: ["f32"]
    core.runner.batches.note_builds = lambda rows, width: None
    core.info = SimpleNamespace(context_length=4096)
    core.sched = SimpleNamespace(prefill_chunk=512, prefilling=[], running=[], preempted=[])
    monkeypatch.setattr(kernel_disk_cache, "filer", lambda: None)
    engine_core._warm_decode(core, 2, later_rows=4)
    assert log == [("compile", 1), ("compile", 2)]  # before ready: the model dtype's warm rows only
    assert core._shapes_to_warm == [(4, 32), (1, 16, "f32"), (2, 16, "f32"), (4, 16, "f32")]
    while engine_core.has_idle_work(core):
        engine_core.idle_work(core)
    assert log[2:] == [("compile", 4), ("compile", 1, "f32"), ("compile", 2, "f32"), ("compile", 4, "f32")]
    engine_core._kernels_replaced(core)
    assert len(core._shapes_to_warm) == 6
    log.clear()
    assert engine_core.warm_wider_shapes(core, 2) == 2  # the rehearsal: the other dtype's warm rows at once
    assert log == [("compile", 1, "f32"), ("compile", 2, "f32")]
    assert core._shapes_to_warm == [(1, 32), (2, 32), (4, 32), (4, 16, "f32")]


def test_idle_work_hands_what_it_made_back_after_the_next_idle_spell():
    """A trace at idle may make a pool again after the idle release handed them back: the release
    is due again `idle_release_s` after the last idle work, not only after the next step."""
    core, engine_core = _core(lambda rows, width: True)
    assert core._idle_since is None  # released, or never idle
    engine_core.idle_work(core)
    assert core._idle_since is not None
    core._idle_since, core.has_work = None, lambda: True
    engine_core.idle_work(core)
    assert core._idle_since is None  # work came: the step that runs it sets the clock


def test_decode_shapes_compiled_in_a_row_log_their_progress_every_few_seconds_and_the_last(monkeypatch, caplog):
    """Tens of quick shapes log a line every SHAPE_LOG_S (and the last, and a slow one) instead of
    one each, which the log's repeat limit would cut off halfway through."""
    from vlmserve.engine import core as engine_module

    clock = iter(range(100, 1000))  # one second a shape
    monkeypatch.setattr(engine_module.time, "monotonic", lambda: float(next(clock)))
    core, engine_core = _core(lambda rows, width: True)
    core._shapes_to_warm = [(n, 32) for n in range(1, 8)]
    with caplog.at_level(logging.DEBUG, logger="vlmserve.engine.core"):
        while core._shapes_to_warm:
            engine_core._warm_next_shape(core)
    lines = [r for r in caplog.records if "compiled the decode step" in r.getMessage()]
    shown = [r.getMessage().split(" (")[1] for r in lines if r.levelno == logging.INFO]
    assert len(lines) == 7 and shown == ["6 to go)", "4 to go)", "2 to go)", "0 to go)"]
    caplog.clear()
    core.runner.batches.warm_shape = lambda rows, width: rows < 2  # traffic compiled the last one
    core._shapes_to_warm = [(1, 64), (2, 64)]
    with caplog.at_level(logging.INFO, logger="vlmserve.engine.core"):
        while core._shapes_to_warm:
            engine_core._warm_next_shape(core)
    assert "(0 to go)" in caplog.records[-1].getMessage()
