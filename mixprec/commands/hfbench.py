"""``mixprec bench --model hf-gpt2|hf-llama|hf-bert``: a Hugging Face transformer trained at
each level next to fp32 and plain ``torch.autocast``.

The models are built from small configs (nothing is downloaded) and train with AdamW on one fixed
synthetic batch, loss from the model itself (``labels=``), dropout off (every row sees the same
function). The rows: ``fp32``; ``autocast``
(``torch.autocast`` around the forward, what most people write); ``O1``, ``O2``, ``O3``;
``compact`` (O2 with Kahan-compensated 16-bit masters and bf16 moments); ``fp8`` (O2 with the
Linear layers' GEMMs in FP8, tensorwise). Every row runs the same loop: forward,
``loss.backward()``, ``opt.step()``, ``opt.zero_grad()``.

Columns, each measured with the rows interleaved in one process (a loaded machine slows them
alike) and repeated, medians:

* **ms/step**: the model at its bench size on the threads torch uses.
* **host us/step**: the same model at width 32, 16 tokens, batch 1, on one thread: its kernels
  cost next to nothing, so the time is the host's (Python and dispatch), what decides the step
  time of a launch-bound model on a GPU.
* **peak MB**: the largest number of bytes held by live tensors from building the model through
  two steps, from the profiler's allocation events (exact and independent of the process's other
  memory; oneDNN's own scratch buffers are not tensors and not counted).
* **final loss**: after ``warmup + rounds * steps`` steps on the same batch.

``mixprec bench --model hf-*`` takes ``--levels`` (rows among :data:`ROWS`; ``O0`` is ``fp32``),
``--no-reference`` (no ``autocast`` row), ``--steps``/``--warmup``/``--repeat`` (steps per round,
untimed steps first, rounds: at least 5), ``--depth`` (layers), ``--width``, ``--seq-len``,
``--batch``, ``--dtype`` and ``--compile`` (the mixprec rows' forward and loss under
``torch.compile`` and, where it applies, the compiled master step, as ``Trainer(compile=True)``;
the fp32 and autocast rows stay eager). It refuses ``--device`` other than ``cpu`` (the peak MB
and host columns read the CPU's allocation events and thread time) and ``--image-size``.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time

import torch

import mixprec as mp

from ..lowbit.backend import quiet_import
from ..optim import compile_master_step

__all__ = ["HF_MODELS", "ROWS", "LEGEND", "run_hf_bench", "format_hf_table", "run_from_args",
           "parse_rows", "quiet_profiler"]

ROWS = ("fp32", "autocast", "O1", "O2", "O3", "compact", "fp8")
_MIXPREC_ROWS = ("O1", "O2", "O3", "compact", "fp8")  # the rows --compile compiles
#: printed under the table: what each column means (the autocast and fp8 lines where those
#: rows are in it)
LEGEND = {
    "autocast": "vs autocast: the row's figure over the autocast row's (torch.autocast around "
                "the forward); above 1.00x the row is slower (or holds more memory) than "
                "torch.autocast, below 1.00x faster (less)",
    "host": "host us/step: CPU time of one step of the same model at width 32, seq 16, batch 1 "
            "on one thread, where kernels cost next to nothing: Python and dispatch overhead, "
            "what bounds the step of a launch-bound model on a GPU",
    "peak": "peak MB: the most bytes live tensors held at once from building the model through "
            "two steps",
    "fp8": "fp8: on a CPU FP8 is emulated (quantize, dequantize, a 16- or 32-bit GEMM): its time "
           "is what the emulation costs, not what FP8 hardware would gain"}
_HOST = {"width": 32, "seq": 16, "batch": 1}


def _gpt2(width, seq, batch, vocab, depth=4):
    import transformers
    cfg = transformers.GPT2Config(n_layer=depth, n_embd=width, n_head=4, n_positions=max(seq, 16),
                                  vocab_size=vocab, bos_token_id=0, eos_token_id=0,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def _llama(width, seq, batch, vocab, depth=4):
    import transformers
    cfg = transformers.LlamaConfig(num_hidden_layers=depth, hidden_size=width,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=width * 8 // 3,
                                   max_position_embeddings=max(seq, 16), vocab_size=vocab,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def _bert(width, seq, batch, vocab, depth=4):
    import transformers
    cfg = transformers.BertConfig(num_hidden_layers=depth, hidden_size=width, num_attention_heads=4,
                                  intermediate_size=width * 4, max_position_embeddings=max(seq, 16),
                                  vocab_size=vocab, pad_token_id=0, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(cfg)


#: --model name -> (builder, what it is)
HF_MODELS = {"hf-gpt2": (_gpt2, "GPT-2 causal LM"), "hf-llama": (_llama, "Llama causal LM"),
             "hf-bert": (_bert, "BERT masked LM")}


def _batch(sizes: dict) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, sizes["vocab"], (sizes["batch"], sizes["seq"]), generator=g)
    return {"input_ids": ids, "labels": ids}


def _setup(model_name: str, row: str, sizes: dict, compile: bool = False):
    """(model, optimizer, step) for one row, the model built from the same seed; ``compile``:
    a mixprec row's forward (loss included) under ``torch.compile``, its master step compiled
    where :func:`~mixprec.optim.compile_master_step` applies."""
    torch.manual_seed(0)
    with quiet_import():  # transformers' model modules import torchao when it is installed
        model = HF_MODELS[model_name][0](sizes["width"], sizes["seq"], sizes["batch"],
                                         sizes["vocab"], sizes.get("depth", 4))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dtype = sizes.get("dtype", "bf16")
    options = {"O1": {"level": "O1"}, "O2": {"level": "O2"}, "O3": {"level": "O3"},
               "compact": {"level": "O2", "master": "kahan", "state_dtype": "bf16"},
               "fp8": {"level": "O2", "fp8": mp.lowbit.Float8()}}
    if row in options:
        model, opt = mp.prepare(model, opt, dtype=dtype, **options[row])
    forward = model
    if compile and row in _MIXPREC_ROWS:
        forward = torch.compile(model)
        compile_master_step(opt)
    low = torch.bfloat16 if dtype == "bf16" else torch.float16
    batch = _batch(sizes)

    def step() -> float:
        with torch.autocast("cpu", dtype=low, enabled=row == "autocast"):
            loss = forward(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return model, opt, step


def _interleaved(steps_of: dict, rounds: int, steps: int, warmup: int,
                 clock=time.perf_counter) -> tuple[dict, dict]:
    """Median seconds per step of each row, rows interleaved round by round; last losses."""
    losses = {row: None for row in steps_of}
    for row, step in steps_of.items():
        for _ in range(warmup):
            losses[row] = step()
    times: dict[str, list[float]] = {row: [] for row in steps_of}
    for _ in range(rounds):
        for row, step in steps_of.items():
            t0 = clock()
            for _ in range(steps):
                losses[row] = step()
            times[row].append((clock() - t0) / steps)
    return {row: statistics.median(t) for row, t in times.items()}, losses


def live_bytes_peak(fn) -> int:
    """The most bytes live tensors held at once while ``fn()`` ran, above where it started."""
    gc.collect()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        fn()
    # every allocation and free, in order (the function events fold those inside an op into it)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and str(e.device_type()).endswith("CPU"))
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def _peak_mb(model_name: str, row: str, sizes: dict, compile: bool = False) -> float:
    def two_steps():
        _, _, step = _setup(model_name, row, sizes, compile)
        step()
        step()
    return round(live_bytes_peak(two_steps) / 2**20, 1)


def run_hf_bench(model_name: str, *, width: int = 128, seq: int = 64, batch: int = 4,
                 vocab: int = 4096, rounds: int = 5, steps: int = 2, warmup: int = 2,
                 rows=ROWS, dtype: str = "bf16", depth: int = 4, compile: bool = False) -> dict:
    """Every figure of the table for one model (see the module's docstring)."""
    if model_name not in HF_MODELS:
        raise ValueError(f"model must be one of {', '.join(HF_MODELS)}; got {model_name!r}")
    bad = [r for r in rows if r not in ROWS]
    if bad or not rows:
        raise ValueError(f"rows must be among {', '.join(ROWS)}; got {bad or list(rows)}")
    for name, value, least in (("rounds", rounds, 1), ("steps", steps, 1), ("warmup", warmup, 0),
                               ("depth", depth, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}; got {value!r}")
    if compile and warmup < 1:
        raise ValueError("compile=True (--compile) needs warmup >= 1: the first step compiles, "
                         "and its time must not fall in the timed steps")
    sizes = {"width": width, "seq": seq, "batch": batch, "vocab": vocab, "dtype": dtype,
             "depth": depth}
    step_fns = {row: _setup(model_name, row, sizes, compile)[2] for row in rows}
    ms, losses = _interleaved(step_fns, rounds, steps, warmup)
    del step_fns
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        host_sizes = {**sizes, **_HOST, "vocab": 256}
        host_fns = {row: _setup(model_name, row, host_sizes, compile)[2] for row in rows}
        host, _ = _interleaved(host_fns, rounds * 3, 5, 3, clock=time.thread_time)
        del host_fns
    finally:
        torch.set_num_threads(threads)
    peak = {row: _peak_mb(model_name, row, sizes, compile) for row in rows}
    return {"model": model_name, "what": HF_MODELS[model_name][1], "sizes": sizes,
            "torch": torch.__version__, "threads": threads, "steps": steps, "warmup": warmup,
            "rounds": rounds, "compile": compile,
            "rows": [{"row": row, "ms_per_step": round(ms[row] * 1e3, 2),
                      "host_us_per_step": round(host[row] * 1e6),
                      "peak_mb": peak[row], "final_loss": round(losses[row], 4)}
                     for row in rows]}


def format_hf_table(rep: dict) -> str:
    base = {k: next(r[k] for r in rep["rows"] if r["row"] == "autocast")
            for k in ("ms_per_step", "host_us_per_step", "peak_mb")} \
        if any(r["row"] == "autocast" for r in rep["rows"]) else None
    s = rep["sizes"]
    compiled = "; mixprec rows compiled" if rep.get("compile") else ""
    lines = [f"{rep['what']} ({rep['model']}): width {s['width']}, {s.get('depth', 4)} layers, "
             f"seq {s['seq']}, batch {s['batch']}, vocab {s['vocab']}, {s['dtype']}, AdamW; torch "
             f"{rep['torch']}, {rep['threads']} threads, cpu{compiled}; host: width 32, seq 16, "
             f"batch 1, 1 thread", "",
             "| row | ms/step | vs autocast | host us/step | vs autocast | peak MB | "
             "vs autocast | final loss |", "|---|---|---|---|---|---|---|---|"]
    for r in rep["rows"]:
        def rel(k):
            return f"{r[k] / base[k]:.2f}x" if base and base[k] else "-"
        lines.append(f"| {r['row']} | {r['ms_per_step']:.1f} | {rel('ms_per_step')} | "
                     f"{r['host_us_per_step']} | {rel('host_us_per_step')} | {r['peak_mb']} | "
                     f"{rel('peak_mb')} | {r['final_loss']:.4f} |")
    shown = {r["row"] for r in rep["rows"]}
    legend = [text for key, text in LEGEND.items() if key in shown or key in ("host", "peak")]
    return "\n".join([*lines, "", *legend])


def parse_rows(levels, reference: bool = True) -> list[str]:
    """The rows ``--levels`` (names or None: all) and ``--no-reference`` ask for, in
    :data:`ROWS` order; ``O0`` names the ``fp32`` row, case does not matter."""
    names = {r.lower(): r for r in ROWS} | {"o0": "fp32"}
    wanted = [r for r in ROWS if r != "autocast"] if levels is None else levels
    bad = [x for x in wanted if x.lower() not in names]
    if bad:
        raise ValueError(f"unknown row(s) {bad} for the hf- models; choose from "
                         f"{', '.join(ROWS)} (O0 = fp32; comma-separated)")
    chosen = {names[x.lower()] for x in wanted} | ({"autocast"} if reference else set())
    return [r for r in ROWS if r in chosen]


def quiet_profiler() -> None:
    """Keep kineto (torch's profiler, behind the peak MB column) from printing a ``USDT`` trace
    line at every profiler start and stop: its log level, read once per process when the
    profiler first starts, set above them unless the environment already sets one. For the
    ``mixprec bench`` process, which owns its environment."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")


def _refuse_options(args) -> None:
    """The ``mixprec bench`` options the hf- models cannot honour: a ValueError naming each."""
    if args.device != "cpu":
        raise ValueError(f"--device {args.device}: the hf- models run on the CPU only (peak MB "
                         f"reads the profiler's CPU allocation events, host us/step the CPU "
                         f"thread's time); --device cuda times --model nine-linear, convnet or "
                         f"transformer")
    if args.image_size is not None:
        raise ValueError("--image-size: the hf- models take tokens, not images (their sizes: "
                         "--width, --depth, --seq-len, --batch)")


def run_from_args(args) -> int:
    """``mixprec bench --model hf-*``: the table (or ``--json``) for the parsed arguments
    (``--in-process`` changes nothing: these rows always run interleaved in this process)."""
    _refuse_options(args)
    sizes = {k: getattr(args, a) for k, a in (("width", "width"), ("batch", "batch"),
                                              ("seq", "seq_len"), ("depth", "depth"),
                                              ("steps", "steps"), ("warmup", "warmup"))
             if getattr(args, a) is not None}
    dtype = "bf16" if args.dtype == "auto" else args.dtype
    rows = parse_rows(args.levels, reference=not args.no_reference)
    quiet_profiler()
    rep = run_hf_bench(args.model, rounds=max(args.repeat, 5), dtype=dtype, rows=rows,
                       compile=args.compile, **sizes)
    print(json.dumps(rep, indent=2) if args.json else format_hf_table(rep))
    return 0
