"""``specplugin check-lossless``: speculation must not change what the target generates.

1. **Greedy**: on the pair's target and workloads, every output token equals the one
   without speculation (float32 unless ``--dtype``).
2. **Sampling** (temperature 1): on a tiny-vocabulary model with repetitive prompts,
   thousands of draws per prompt; per output position a two-sample chi-square test must
   not reject at ``alpha / number of tests`` (Bonferroni). ``--power-check``: temperature
   0.9 without speculation must be told apart (a positive control).

Both fail when nothing was drafted or accepted. Exit 0 pass, 1 failure, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

DEFAULT_ALPHA = 1e-3
GREEDY_DTYPE = "float32"


@dataclass(frozen=True)
class SamplingPlan:
    num_prompts: int
    prompt_len: int
    draws_per_prompt: int
    num_positions: int  # output positions tested (max_tokens)


FULL_SAMPLING = SamplingPlan(num_prompts=4, prompt_len=24, draws_per_prompt=5000, num_positions=8)
QUICK_SAMPLING = SamplingPlan(num_prompts=2, prompt_len=24, draws_per_prompt=2000, num_positions=6)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options only: importing this module must stay cheap (no vLLM, no torch)."""
    from specplugin.bench.families import DTYPES
    from specplugin.bench.methods import METHODS, PLUGIN, names_in
    from specplugin.bench.runner import add_eager_argument
    from specplugin.cli import int_option
    from specplugin.zoo import PAIR_HELP

    parser.add_argument("--zoo", help=PAIR_HELP)
    parser.add_argument("--methods", default=None,
                        help="comma-separated speculative methods to check (default: all of "
                             f"{', '.join(m for m in METHODS if m != 'none')}; "
                             "--quick: the plugin's listed ones, "
                             f"{', '.join(names_in(PLUGIN))})")
    parser.add_argument("--quick", action="store_true", help="fewer prompts and draws (minutes)")
    parser.add_argument("--alpha", type=_alpha, default=DEFAULT_ALPHA,
                        help="family-wise false-alarm rate of the sampling check, in (0, 0.5]")
    parser.add_argument("--draws", type=int_option("--draws", 100), default=None,
                        help="draws per prompt (sampling), at least 100")
    parser.add_argument("--skip-greedy", action="store_true")
    parser.add_argument("--batch-size", type=int, choices=(1, 8, 32), default=8,
                        help="the greedy check's batch (default 8; 1: requests one after the "
                             "other, each engine's max_num_seqs 1, where bf16 differs most; "
                             "32: as many requests)")
    parser.add_argument("--skip-sampling", action="store_true")
    parser.add_argument("--power-check", action=argparse.BooleanOptionalAction, default=None,
                        help="also run a positive control (temperature 0.9) the test must tell apart "
                             "(default: on unless --quick)")
    parser.add_argument("--out-dir", default="bench-out/lossless", help="engine logs")
    parser.add_argument("--dtype", choices=DTYPES, default=GREEDY_DTYPE,
                        help="vLLM's dtype of the greedy check, for every pair (default "
                             f"{GREEDY_DTYPE}: in bf16 a verification pass over several tokens "
                             "rounds differently from one-token steps, and near-ties flip "
                             "without any fault of speculation; the sampled check's tiny model "
                             "always runs in float32)")
    add_eager_argument(parser)


def _alpha(text: str) -> float:
    """--alpha: 0 or less would make the threshold 0 and the check unfailable."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--alpha must be a number; got {text!r}") from None
    if not 0.0 < value <= 0.5:
        raise argparse.ArgumentTypeError(
            f"--alpha must be in (0, 0.5] (a false-alarm rate; default {DEFAULT_ALPHA:g}); "
            f"got {text}. At 0 or below no p-value could fail the check.")
    return value


# ---------------------------------------------------------------- method selection


def _selected(args: argparse.Namespace):
    from specplugin.bench.cli import csv_list
    from specplugin.bench.methods import BASELINE, METHODS, PLUGIN, names_in, resolve

    if args.methods:
        names = csv_list(args.methods)
    else:
        names = (names_in(PLUGIN) if args.quick
                 else [m for m, spec in METHODS.items() if spec.family != BASELINE])
    specs = resolve(names)
    if any(s.family == BASELINE for s in specs):
        raise ValueError("'none' is the reference every method is compared with; "
                         "list speculative methods only.")
    return specs


# the positive control: a small known change the test must detect (vLLM's synthetic
# acceptance mode does not run on CPU)
CONTROL_TEMPERATURE = 0.9


# ---------------------------------------------------------------- engines


@dataclass
class Engines:
    """Runs one configuration per call in a fresh engine child; returns cells with token ids."""

    workdir: Path
    console: Any
    eager: bool = False  # enforce_eager (the tests); default vLLM's compiled mode
    warned: set[str] = field(default_factory=set)

    def run(self, spec, models, payload: Sequence[Mapping[str, Any]], label: str,
            seed: int = 0, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        from specplugin.bench.methods import PLUGIN
        from specplugin.bench.runner import EngineJob, max_num_seqs, run_job

        settings = dict(spec.settings)
        if spec.family == PLUGIN:  # speculate every step: the check needs drafts to verify
            settings["step_arbiter"] = False
        kwargs = {**spec.engine_kwargs(models, settings), "seed": seed,
                  "max_num_seqs": max_num_seqs(payload), **(extra or {})}
        job = EngineJob(label=label, model=models.target, engine_kwargs=kwargs,
                        cells=tuple(payload), eager=self.eager, return_token_ids=True)
        with self.console.status(f"{label}: running one engine"):
            result = run_job(job, self.workdir)
        for warning in set(result.warnings) - self.warned:
            self.console.print(f"[yellow]warning: {warning}[/yellow]")
            self.warned.add(warning)
        return result.cells

    def fail(self, label: str, reason: Any) -> bool:
        self.console.print(f"[red]FAIL {label}: {reason}[/red]")
        return False


# ---------------------------------------------------------------- greedy


def first_difference(expected: Sequence[int], actual: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts); None if equal."""
    for i, (a, b) in enumerate(zip(expected, actual)):
        if a != b:
            return i
    return None if len(expected) == len(actual) else min(len(expected), len(actual))


def greedy_mismatches(reference: Mapping[str, Any], candidate: Mapping[str, Any]) -> list[dict]:
    """Per cell key, compare token ids request by request; one record per differing request."""
    out = []
    for key, ref in reference.items():
        if key not in candidate:
            out.append({"cell": key, "request": None, "position": None, "expected": "cell",
                        "got": "missing"})
            continue
        got = candidate[key]["token_ids"]
        if len(got) != len(ref["token_ids"]):
            out.append({"cell": key, "request": min(len(got), len(ref["token_ids"])),
                        "position": None, "expected": f"{len(ref['token_ids'])} requests",
                        "got": f"{len(got)} requests"})
        for i, (expected, actual) in enumerate(zip(ref["token_ids"], got)):
            pos = first_difference(expected, actual)
            if pos is not None:
                out.append({"cell": key, "request": i, "position": pos,
                            "expected": expected[pos] if pos < len(expected) else None,
                            "got": actual[pos] if pos < len(actual) else None})
    return out


# family name -> (full workloads, --quick workloads, --quick size changes); 16 requests, t0
GREEDY_PLAN = {
    "code windows": (("edit", "complete", "mixed"), ("mixed",), {"max_tokens": 64}),
    "instruct": (("code-edit", "explain", "chat"), ("chat-mix",), {}),
}


def _greedy_cells(zoo_root: Path, quick: bool, batch_size: int = 8):
    from specplugin.bench.families import family_for
    from specplugin.bench.workloads import Cell

    family = family_for(zoo_root)
    full, short, quick_changes = GREEDY_PLAN[family.name]
    sizes = replace(family.quick_sizes if quick else family.sizes,
                    min_requests=max(16, batch_size),
                    **(quick_changes if quick else {}))
    source = family.load_source(zoo_root)
    return [family.build(source, sizes, Cell(w, batch_size, 0.0), 7)
            for w in (short if quick else full)]


def check_greedy(specs, zoo: str | None, quick: bool, engines: Engines,
                 dtype: str = GREEDY_DTYPE, defaults: bool = False, batch_size: int = 8) -> bool:
    """Token-for-token equality with the non-speculative run on the pair's target.
    ``defaults``: methods needing a missing draft model are skipped, not failed."""
    from specplugin.bench.cli import zoo_models
    from specplugin.bench.methods import METHODS, runnable
    from specplugin.bench.runner import EngineFailure, cells_payload

    zoo_root, models = zoo_models(zoo)
    payload = cells_payload(_greedy_cells(zoo_root, quick, batch_size))
    num_requests = sum(len(c["prompts"]) for c in payload)
    length = (f"{payload[0]['max_tokens']} tokens" if payload[0]["ignore_eos"]
              else f"up to {payload[0]['max_tokens']} tokens (stop at EOS)")
    engines.console.rule(f"greedy: {num_requests} requests x {length}, {dtype}, "
                         f"cells {', '.join(c['key'] for c in payload)}")
    if defaults:
        names, dropped = runnable([s.name for s in specs], models)
        if dropped:
            engines.console.print(f"skipped (no draft model beside {models.target}): "
                                  f"{', '.join(dropped)}")
        specs = [s for s in specs if s.name in names]
    extra = {"dtype": dtype}
    try:
        reference = engines.run(METHODS["none"], models, payload, "greedy-none", extra=extra)
    except EngineFailure as failure:
        return engines.fail("reference run", failure)
    ok = True
    for spec in specs:
        ok &= _greedy_one(spec, models, payload, reference, engines, extra)
    return ok


def _greedy_one(spec, models, payload, reference, engines: Engines,
                extra: Mapping[str, Any] | None = None) -> bool:
    from specplugin.bench.runner import EngineFailure

    try:
        cells = engines.run(spec, models, payload, f"greedy-{spec.name}", extra=extra)
    except (EngineFailure, ValueError) as failure:
        return engines.fail(spec.name, failure)
    bad = greedy_mismatches(reference, cells)
    num_drafts = sum(c["num_drafts"] for c in cells.values())
    num_accepted = sum(c["num_accepted_tokens"] for c in cells.values())
    counts = f"drafts {num_drafts}, accepted tokens {num_accepted}" + _scorer_counts(cells.values())
    if not (num_drafts > 0 and num_accepted > 0):
        return engines.fail(spec.name, f"no drafts were proposed or accepted ({counts}); "
                                       "identical outputs prove nothing")
    if _forces_extra_candidates(spec) and not _scorer_wins(cells.values()):
        return engines.fail(spec.name, f"no extra candidate won ({counts}); the scorer's "
                                       "winners were not tested")
    if bad:
        engines.fail(spec.name, f"{len(bad)} request(s) differ ({counts})")
        for m in bad[:10]:
            engines.console.print(f"    cell {m['cell']} request {m['request']}: first "
                                  f"difference at output position {m['position']}: expected "
                                  f"{m['expected']}, got {m['got']}")
        return False
    engines.console.print(f"[green]ok[/green]   {spec.name}: all outputs identical ({counts})")
    return True


# ---------------------------------------------------------------- sampling


@dataclass(frozen=True)
class SampledTest:
    prompt: int
    position: int
    statistic: float
    dof: int
    p_value: float


def compare_samples(reference: Sequence[Sequence[Sequence[int]]],
                    candidate: Sequence[Sequence[Sequence[int]]],
                    num_positions: int, vocab_size: int) -> list[SampledTest]:
    """One chi-square test per (prompt, position); inputs [num_prompts][num_draws][num_tokens]."""
    import torch

    from specplugin.stats import chi_square_homogeneity

    def counts(draws, pos):  # [vocab_size]: the token at ``pos`` over draws
        return torch.bincount(torch.tensor([t[pos] for t in draws], dtype=torch.long),
                              minlength=vocab_size)

    if len(reference) != len(candidate):
        raise ValueError(f"{len(candidate)} prompts sampled with speculation against "
                         f"{len(reference)} without; every prompt must be compared")
    tests = []
    for j, (ref, cand) in enumerate(zip(reference, candidate)):
        for pos in range(num_positions):
            r = chi_square_homogeneity(counts(ref, pos), counts(cand, pos))
            tests.append(SampledTest(j, pos, r.statistic, r.dof, r.p_value))
    return tests


def _split_by_prompt(cell: Mapping[str, Any], num_prompts: int) -> list[list[list[int]]]:
    draws = len(cell["token_ids"]) // num_prompts  # outputs come prompt by prompt, n each
    if draws == 0 or draws * num_prompts != len(cell["token_ids"]):
        raise ValueError(f"{len(cell['token_ids'])} sampled outputs do not split into "
                         f"{num_prompts} prompts of equal draws; requests went missing")
    return [cell["token_ids"][j * draws : (j + 1) * draws] for j in range(num_prompts)]


@dataclass(frozen=True)
class SampledSetup:
    """What every sampled comparison shares: models, the request, the reference draws."""

    models: Any
    payload: tuple[dict[str, Any], ...]
    plan: SamplingPlan
    threshold: float  # per-test p-value below which a comparison fails
    reference: tuple = ()  # [num_prompts][num_draws][num_tokens], without speculation


# no tokenizer (prompts are token ids); all draws of a prompt run at once
TINY_ENGINE_KWARGS = {"skip_tokenizer_init": True, "max_model_len": 128, "max_num_seqs": 256}


def check_sampling(specs, plan: SamplingPlan, alpha: float, power_check: bool,
                   engines: Engines) -> bool:
    """Chi-square comparisons on a tiny-vocabulary model built in a temporary folder."""
    from specplugin.bench.methods import Models
    from specplugin.bench.tinymodel import TINY_DRAFT, TINY_TARGET, build_tiny_llama

    with tempfile.TemporaryDirectory(prefix="specplugin-tiny-") as tmp:
        tiny = Path(tmp)
        models = Models(str(build_tiny_llama(tiny / "target", TINY_TARGET)),
                        str(build_tiny_llama(tiny / "draft", TINY_DRAFT)))
        return _check_sampling_on(specs, models, plan, alpha, power_check, engines)


def _sampled_payload(plan: SamplingPlan) -> tuple[dict[str, Any], ...]:
    from specplugin.bench.tinymodel import TINY_TARGET, repetitive_prompts

    prompts = repetitive_prompts(TINY_TARGET.vocab_size, plan.num_prompts, plan.prompt_len)
    return ({"key": "sampled", "workload": "repetitive", "batch_size": len(prompts),
             "temperature": 1.0, "max_tokens": plan.num_positions,
             "n": plan.draws_per_prompt, "prompts": prompts},)


def _check_sampling_on(specs, models, plan: SamplingPlan, alpha: float, power_check: bool,
                       engines: Engines) -> bool:
    from specplugin.bench.methods import METHODS
    from specplugin.bench.runner import EngineFailure
    from specplugin.bench.tinymodel import TINY_TARGET

    num_tests = plan.num_prompts * plan.num_positions
    setup = SampledSetup(models, _sampled_payload(plan), plan, alpha / num_tests)
    engines.console.rule(
        f"sampling: tiny Llama (vocab {TINY_TARGET.vocab_size}), {plan.num_prompts} prompts x "
        f"{plan.draws_per_prompt} draws, positions 0-{plan.num_positions - 1}; fail if "
        f"p < {alpha:g} / {num_tests} tests = {setup.threshold:.2e}")
    try:
        ref = engines.run(METHODS["none"], models, setup.payload, "sampled-none", seed=1,
                          extra=TINY_ENGINE_KWARGS)["sampled"]
    except EngineFailure as failure:
        return engines.fail("reference run", failure)
    setup = replace(setup, reference=tuple(_split_by_prompt(ref, plan.num_prompts)))
    ok = True
    for i, spec in enumerate(specs):
        ok &= _sampled_one(spec, spec.name, setup, engines, seed=2 + i, is_control=False)
    if power_check:
        control = replace(setup, payload=tuple({**cell, "temperature": CONTROL_TEMPERATURE}
                                               for cell in setup.payload))
        ok &= _sampled_one(METHODS["none"], f"control-T{CONTROL_TEMPERATURE:g}", control,
                           engines, seed=100, is_control=True)
    return ok


def _sampled_one(spec, label: str, setup: SampledSetup, engines: Engines, seed: int,
                 is_control: bool) -> bool:
    """Draw with ``spec`` and test against the reference; a control must be told apart. The
    plugin's methods run their draft model wherever a row could use it (a test switch):
    left to price it on these six-token requests, the draft's gate has kept it idle for a
    whole run (seen in 2 of 4), and a check with nothing drafted proves nothing."""
    from specplugin.bench.methods import PLUGIN
    from specplugin.bench.runner import EngineFailure
    from specplugin.bench.tinymodel import TINY_TARGET

    if spec.family == PLUGIN and not is_control:
        faults = {**spec.settings.get("fault_injection", {}), "draft_always": True}
        spec = replace(spec, settings={**spec.settings, "fault_injection": faults})

    try:
        cell = engines.run(spec, setup.models, setup.payload, f"sampled-{label}", seed=seed,
                           extra=TINY_ENGINE_KWARGS)["sampled"]
    except (EngineFailure, ValueError) as failure:
        return engines.fail(label, failure)
    try:
        tests = compare_samples(setup.reference, _split_by_prompt(cell, setup.plan.num_prompts),
                                setup.plan.num_positions, TINY_TARGET.vocab_size)
    except ValueError as err:
        return engines.fail(label, err)
    worst = min(tests, key=lambda t: t.p_value)
    _print_sampled(label, tests, worst, setup.threshold, cell, engines.console)
    if _forces_extra_candidates(spec) and not _scorer_wins([cell]):
        return engines.fail(label, "no extra candidate won; the scorer's sampling path "
                                   "was not tested")
    return _verdict(label, worst.p_value >= setup.threshold, cell, is_control, engines)


def _scorer_counts(cells) -> str:
    """", extra rows N, extra candidates won M" when the batch-expanding scorer ran."""
    scored = [c["scorer"] for c in cells if c.get("scorer")]
    if not scored:
        return ""
    return (f", extra rows {sum(s['extra_rows'] for s in scored)}, "
            f"extra candidates won {_scorer_wins(cells)}")


def _scorer_wins(cells) -> int:
    return sum((c.get("scorer") or {}).get("wins", 0) for c in cells)


def _forces_extra_candidates(spec) -> bool:
    """Methods verifying every draft beside a decoy (test switch): they prove nothing
    about the scorer unless extra candidates won."""
    return bool(spec.settings.get("fault_injection", {}).get("decoy_primary"))


def _verdict(label: str, same: bool, cell: Mapping[str, Any], is_control: bool,
             engines: Engines) -> bool:
    if is_control:
        if same:
            return engines.fail(label, f"the test did not tell temperature "
                                       f"{CONTROL_TEMPERATURE:g} from 1 apart: too few draws")
        engines.console.print(f"[green]ok[/green]   {label}: told apart from the reference, "
                              "as it must be")
        return True
    if not (cell["num_drafts"] > 0 and cell["num_accepted_tokens"] > 0):
        return engines.fail(label, "no drafts were proposed or accepted; the test proves nothing")
    if not same:
        return engines.fail(label, "the sampled distribution differs from the target's")
    engines.console.print(f"[green]ok[/green]   {label}: same distribution as without speculation")
    return True


def _print_sampled(name: str, tests: Sequence[SampledTest], worst: SampledTest, threshold: float,
                   cell: Mapping[str, Any], console) -> None:
    rejected = cell["num_draft_tokens"] - cell["num_accepted_tokens"]
    console.print(f"  {name}: drafts {cell['num_drafts']}, draft tokens {cell['num_draft_tokens']}, "
                  f"accepted {cell['num_accepted_tokens']}, rejected {rejected}"
                  + _scorer_counts([cell]))
    for t in tests:
        mark = "[red]<[/red]" if t.p_value < threshold else " "
        console.print(f"    prompt {t.prompt} pos {t.position}: chi2 {t.statistic:7.2f} "
                      f"dof {t.dof:2d} p {t.p_value:.3g} {mark}", highlight=False)
    console.print(f"  worst: prompt {worst.prompt} pos {worst.position}, chi2 {worst.statistic:.2f}, "
                  f"dof {worst.dof}, p {worst.p_value:.3g} (threshold {threshold:.2e})")


# ---------------------------------------------------------------- entry point


def run(args: argparse.Namespace) -> int:
    from specplugin.bench.report import stdout_console

    console = stdout_console()
    try:
        specs = _selected(args)
    except ValueError as err:
        console.print(f"[red]check-lossless: {err}[/red]")
        return 2
    plan = QUICK_SAMPLING if args.quick else FULL_SAMPLING
    if args.draws is not None:
        plan = replace(plan, draws_per_prompt=args.draws)
    power = (not args.quick) if args.power_check is None else args.power_check
    engines = Engines(Path(args.out_dir), console, eager=args.eager)
    console.print(f"check-lossless: methods {', '.join(s.name for s in specs)}")
    ok = True
    if not args.skip_greedy:
        try:
            ok &= check_greedy(specs, args.zoo, args.quick, engines, args.dtype,
                               defaults=not args.methods, batch_size=args.batch_size)
        except FileNotFoundError as err:  # no zoo: say how to get one
            console.print(f"[red]check-lossless: {err}[/red]")
            return 2
    if not args.skip_sampling:
        ok &= check_sampling(specs, plan, args.alpha, power, engines)
    console.rule("[green]PASS[/green]" if ok else "[red]FAIL[/red]")
    return 0 if ok else 1
