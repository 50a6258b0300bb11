"""README tables and plots from the runs of ``benchmarks/accuracy.py``.

    python -m benchmarks.tables            # print the tables, write docs/results/*.png
    python -m benchmarks.tables --readme   # also replace the results blocks (README, docs/)

Only complete runs are used; a row says how many seeds it has.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics

from benchmarks.results_page import (
    ARCHIVE,
    DOCS,
    RESULTS_PAGE,
    SUMMARY,
    archive,
    entries,
    load,
    results_page,
    summary_section,
)
from benchmarks.suites import OUT, REGIMES, ROOT, SUITES

TIMINGS = (
    "overhead.json",
    "fedara-cost.json",
    "server-step.json",
    "compute-cost.json",
    "compute-cost-fedl2g.json",
    "compute-cost-added.json",
    "scale.json",
    "privacy.json",
    "privacy-forms-seed0.json",
    "faults.json",
    "privacy-grid.png",
    "deployment.json",
    "profiles.json",
)


def archive_timings() -> None:
    """Copy the timing benchmarks' JSON from ``benchmarks/out`` to ``docs/results``."""
    for name in TIMINGS:
        if (OUT / name).exists():
            (DOCS / name).write_bytes((OUT / name).read_bytes())


def overhead_section() -> str:
    doc = load("overhead.json")
    if not isinstance(doc, dict):
        return ""
    med = doc["median-excluding-round-1"]
    return "\n".join(
        [
            "#### Simulation overhead",
            "",
            f"`python -m benchmarks.overhead --rounds {doc['rounds']}`: {doc['workload']}; "
            "seconds per round, median with round 1 (start-up) excluded. The bare loop is the "
            "same model, data and training functions in one process with no Flower.",
            "",
            "| run | s / round |",
            "|---|---|",
            f"| bare PyTorch loop, 1 thread | {med['bare-1-thread']:.2f} |",
            f"| bare PyTorch loop, 2 threads | {med['bare-2-thread']:.2f} |",
            f"| fedhet simulation (`flwr run`, 2 Ray actors, 1 thread each) | "
            f"{med['simulation']:.2f} |",
            "",
            f"Ratio simulation / best bare loop: **{doc['ratio-simulation-over-best-bare']:.2f}** "
            f"(target ≤ 1.15); against the 1-thread loop: "
            f"{doc['ratio-simulation-over-bare-1-thread']:.2f}. The simulation is faster than "
            "the bare loop because two clients train at once on the two cores (one thread "
            "each), while a single process with two threads gains little on these small "
            "models and batches of 10.",
            "",
        ]
    )


def fedara_cost_section() -> str:
    doc = load("fedara-cost.json")
    if not isinstance(doc, dict) or "epoch-ratio-to-full-rank" not in doc["tiers"][0]:
        return ""
    server_at, tiers_at = doc.get("server-measured"), doc.get("tiers-measured")
    measured = f", measured {server_at}" if server_at else ""
    if tiers_at != server_at:  # fedara_cost.py --server-only kept older per-tier rows
        measured += (
            " (the per-tier rows below come from an earlier run of the full benchmark"
            + (f", {tiers_at}" if tiers_at else "")
            + "; `--server-only` re-times the server alone)"
        )
    lines = [
        "#### FedARA costs",
        "",
        "`python -m benchmarks.fedara_cost`: server time per round (configure_train "
        "with the decompositions + aggregate_train with the default rule `coverage`: "
        "decoding and checking the replies, each reply's update to its tier at full rank "
        "with its size and their weighted mean, per-direction normalisation, the step), "
        "replies spread round-robin over the 5 default tiers "
        "(CNN-1 extractor, fc1 and fc2 decomposed), median of 5 (3 at 1000 replies), "
        "2 cores, the server's torch threads as in the `threads` column (2: every core, "
        "the default `server-threads = 0`; 1: `server-threads = 1`)" + measured + ".",
        "",
        "Round 1 decomposes with a truncated SVD under either `fedara.truncation`; "
        "round 2 is where `tracked` takes one subspace-iteration step instead.",
        "",
        "| client replies | threads | truncation | server s / round (round 1) | decompose "
        "(configure) s | aggregate s | server s / round (round 2) | decompose s (round 2) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["server"]:
        second = (
            f"{r['server-s-round2']:.2f} | {r['configure-s-round2']:.2f}"
            if "server-s-round2" in r
            else "– | –"
        )
        lines.append(
            f"| {r['clients']} | {r.get('threads', 2)} | {r.get('truncation', 'svd')} | "
            f"{r['server-s']:.2f} | {r['configure-s']:.2f} | {r['aggregate-s']:.2f} | "
            f"{second} |"
        )
    phased = [r for r in doc["server"] if "phases-s-round2" in r and r["clients"] == 100]
    if phased:
        names = ["decompose", "decode-check"]
        names += [n for n in phased[0]["phases-s-round2"] if n not in names]
        lines += [
            "",
            "Where the 100-reply round goes (seconds, medians over the repetitions, "
            "as the strategy times its phases, `server-diagnostics.server-phases-s` in "
            "results.json; `decode-check`: the rest of aggregate_train, decoding and "
            "checking the replies):",
            "",
            "| threads | truncation | round | " + " | ".join(names) + " |",
            "|---|---|---|" + "---|" * len(names),
        ]
        for r in phased:
            for rnd, key in ((1, "phases-s"), (2, "phases-s-round2")):
                cells = " | ".join(f"{r[key].get(n, 0.0):.3f}" for n in names)
                lines.append(f"| {r['threads']} | {r['truncation']} | {rnd} | {cells} |")
    lines += [
        "",
        "Per tier (Fashion-MNIST partition 0 of 20, 2,625 training samples, batch "
        "10, 1 thread; epoch times are medians of 3 with every tier interleaved in one "
        "process; bytes and peak RSS from one fresh ClientApp process per row). `epoch s`: "
        "the default, Frobenius decay applied as one closed-form step per epoch; `decay "
        "every step`: `fedara.decay-every=1`:",
        "",
        "| rank ratio | extractor parameters | upload bytes measured | upload bytes "
        "analytic | epoch s | epoch / full-rank epoch | epoch s, decay every step | "
        "peak RSS MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in doc["tiers"]:
        lines.append(
            f"| {t['rank-ratio']:g} | {t['params']:,} | {t['bytes-up-measured']:,} | "
            f"{t['bytes-up-analytic']:,} | {t['epoch-s']:.2f} | "
            f"{t['epoch-ratio-to-full-rank']:.2f} | {t['epoch-s-decay-every-step']:.2f} | "
            f"{t['peak-rss-mb']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def server_step_section() -> str:
    from benchmarks.server_step import table

    doc = load("server-step.json")
    if not isinstance(doc, dict):
        return ""
    rows = doc["rows"]
    return "\n".join(
        [
            "#### Server step per algorithm",
            "",
            f"`python -m benchmarks.server_step --nodes {rows[0]['nodes']}`: configure_train "
            "+ aggregate_train of one round, every node sampled and replying with the "
            "method's keys and shapes (see the module docstring), the median of rounds 1 to "
            f"{len(rows[0]['cpu-s'])}, {doc['threads']} torch threads, measured "
            f"{doc['measured']}. CPU: the ServerApp process's, every thread; per node-round: "
            "over the replies.",
            "",
            table(rows),
            "",
        ]
    )


def profiles_section() -> str:
    rows = load("profiles.json")
    if not isinstance(rows, list):
        return ""
    lines = [
        "| profile | algorithm | architecture | FedARA rank ratio | batch | threads | "
        "device | peak RSS of one training round (MB) | of which imports (MB) | round s here |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "–" if r.get("rank-ratio") is None else f"{r['rank-ratio']:g}"
        lines.append(
            f"| `{r['profile']}` | {r['algorithm']} | {r['arch']} | {ratio} | "
            f"{r['batch-size']} | {r['threads'] or 'torch default'} | {r['device']} | "
            f"{r['peak-rss-mb']:.0f} | {r.get('rss-after-imports-mb', float('nan')):.0f} | "
            f"{r['round-s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def small(seconds: float) -> str:
    """A cost measured as a difference of process wall times: below 0.1 s it is noise."""
    if seconds < 0.1:
        return "too small to measure this way (under 0.1 s)"
    return f"{seconds:.2f} s"


def cpu_rows(doc: dict) -> list[str]:
    cpu = doc.get("cpu-s-per-round")
    if not cpu:
        return []
    roles = ["superlink+serverapp", "supernode", "executor", "tasks"]
    names = {
        "deployment-warm": "warm",
        "deployment-warm-memory-state": "warm, memory state",
        "deployment-cold": "cold",
    }
    rows = [
        "CPU seconds per round by role (all processes of the federation, sampled every "
        "0.2 s; the simulation's whole round is the wall time above on 2 cores):",
        "",
        "| mode | SuperLink + ServerApp | SuperNodes | executors | ClientApp tasks |",
        "|---|---|---|---|---|",
    ]
    for mode, name in names.items():
        if mode in cpu:
            rows.append(
                f"| {name} | " + " | ".join(f"{cpu[mode].get(r, 0.0):.2f}" for r in roles) + " |"
            )
    return [*rows, ""]


def idle_rows(doc: dict) -> list[str]:
    idle = doc.get("idle-cpu-cores")
    if not idle:
        return []
    return [
        "| idle federation (SuperLink, 3 SuperNodes, executors), after a run | "
        "CPU, share of one core |",
        "|---|---|",
        f"| warm | {idle['deployment-warm']:.1%} |",
        f"| cold (Flower's stock intervals) | {idle['deployment-cold']:.1%} |",
        "",
    ]


def deployment_section() -> str:
    doc = load("deployment.json")
    if not isinstance(doc, dict) or "deployment-warm" not in doc["median-excluding-round-1"]:
        return ""
    med, pp, warm, cold = (
        doc["median-excluding-round-1"],
        doc["per-process"],
        doc["warm"],
        doc["cold-process"],
    )
    return "\n".join(
        [
            "#### Deployment vs simulation",
            "",
            f"`python -m benchmarks.deployment`: {doc['workload']}. Median seconds per round "
            "(round 1 excluded), every mode measured in one run:",
            "",
            "| mode | s / round | × simulation |",
            "|---|---|---|",
            f"| simulation (Ray actors stay alive) | {med['simulation']:.2f} | 1.0 |",
            f"| deployment, warm (`fedhet superexec` + `fedhet supernode`, the default) | "
            f"{med['deployment-warm']:.2f} | **{doc['ratio-warm-over-simulation']:.2f}** |",
            *(
                [
                    "| deployment, warm, the SuperLink's state in memory "
                    "(`fedhet federation --memory-state`) | "
                    f"{med['deployment-warm-memory-state']:.2f} | "
                    f"{doc['ratio-warm-memory-state-over-simulation']:.2f} |"
                ]
                if "deployment-warm-memory-state" in med
                else []
            ),
            f"| deployment, cold (Flower's stock executor, `fedhet federation --cold`) | "
            f"{med['deployment-cold']:.2f} | {doc['ratio-cold-over-simulation']:.2f} |",
            "",
            *cpu_rows(doc),
            "Where a cold message's time goes (fresh processes, medians): Python start-up "
            f"{pp['python-start-s'] * 1000:.0f} ms, imports of the ClientApp "
            f"{pp['import-client-app-s']:.2f} s (torch {pp['import-torch-s']:.2f} s, flwr "
            f"{pp['import-flwr-s']:.2f} s), the data share {small(pp['load-data-share-s'])}, "
            f"building CNN-1 {small(pp['build-cnn1-s'])}; plus Flower's fixed polling (SuperNode "
            "3 s idle pull and 0.5 s reply waits, SuperExec 1 s, the ServerApp's HTTP grid 3 s). "
            "The warm executor pays its parent's imports once "
            f"({warm['warm-parent-start-s']:.1f} s at start-up), then "
            f"{warm['fork-s'] * 1000:.0f} ms per fork and "
            f"{warm['child-imports-data-model-s']:.2f} s for the app's own modules, the data "
            "share and the model in each task; "
            + doc.get(
                "polling",
                "its polls come 0.05 s after a task and then ever less often (0.05 s + 5 % "
                "of the idle time, up to Flower's own intervals), the executor waits on a "
                "running task's child instead of polling, and the ServerApp collects replies "
                "every 0.1 s.",
            ),
            "",
            *idle_rows(doc),
            "| resident memory | MB |",
            "|---|---|",
            f"| a cold ClientApp process, ready to train | {cold['rss-mb']:.0f} |",
            f"| the warm parent (held while the node runs) | {warm['parent']['rss-mb']:.0f} |",
            f"| one warm child: resident / its own pages (the rest shared copy-on-write) | "
            f"{warm['child']['rss-mb']:.0f} / {warm['child']['private-mb']:.0f} |",
            "",
        ]
    )


def scale_section() -> str:
    doc = load("scale.json")
    if not isinstance(doc, dict):
        return ""
    lines = [
        "`python -m benchmarks.scale`: lgfedavg, IID Fashion-MNIST, `cnn` family, 2 rounds; "
        "memory of every process the run starts (SuperLink, SuperExec, simulation, Ray and "
        "its workers), sampled every 0.5 s: Σ PSS (shared pages split among their users) and "
        "Σ RSS.",
        "",
        "| clients | sampled per round (train / evaluate) | s / round | peak Σ PSS (GiB) | "
        "peak Σ RSS (GiB) |",
        "|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['clients']:,} | {r['train-clients-per-round']:.0f} / "
            f"{r['eval-clients-per-round']:.0f} | "
            f"{' / '.join(f'{t:.0f}' for t in r['round-time-s'])} | "
            f"{r['peak-pss-mb'] / 1024:.2f} | {r['peak-rss-mb'] / 1024:.2f} |"
        )
    last = doc["rows"][-1]
    lines += [
        "",
        f"Where the memory is at the peak ({last['clients']:,} clients, Σ PSS by process, MB): "
        + ", ".join(f"{k} {v:.0f}" for k, v in last["pss-mb-at-peak-by-process"].items()),
    ]
    return "\n".join(lines) + "\n"


FORM_NAMES = {
    "raw": "raw representation of one sample",
    "prototype": "class prototype (FedProto, FedGH, FedTGP)",
    "entangled": "entangled representation (FedRE)",
    "gradient": "one sample's head gradient (DLG)",
    "logit": "class mean logits (FD)",
    "guide": "guide-gradient rows (FedL2G-f; labels and quiz direction given)",
    "guide-logit": "guide-gradient rows (FedL2G-l; labels and quiz direction given)",
}


def form_rows(forms: dict) -> list[str]:
    """One table row per audited knowledge form."""
    return [
        f"| {FORM_NAMES.get(form, form)} | {f['n']:.0f} | {f['psnr_closest']:.2f} | "
        f"{f['ssim_closest']:.3f} | {f['psnr_class_mean']:.2f} |"
        for form, f in forms.items()
    ]


def privacy_section() -> str:
    doc = load("privacy.json")
    if not isinstance(doc, dict):
        return ""
    rows = doc["rows"]
    forms = rows["none"]["forms"]
    seeds = ", ".join(str(s) for s in rows["none"].get("seeds", (0, 1, 2)))
    lines = [
        f"`python -m benchmarks.privacy`: FedRE, scarce regime, seeds {seeds}, each run audited on "
        f"its first {doc['clients']} clients (white-box inversion, 300 Adam steps from noise, "
        "total-variation prior). PSNR / SSIM against the client's closest training image of "
        "the class, and PSNR against that class's mean image; higher = more recoverable.",
        "",
        "| knowledge form | reconstructions | PSNR, closest image (dB) | SSIM, closest | "
        "PSNR, class mean (dB) |",
        "|---|---|---|---|---|",
    ]
    lines += form_rows(forms)
    seed0 = load("privacy-forms-seed0.json")
    if isinstance(seed0, dict) and "none" in seed0["rows"]:
        lines += [
            "",
            "Every form the audit knows on one run (`python -m benchmarks.privacy --rows none "
            "--seeds 0 --out benchmarks/out/privacy-forms-seed0.json`: seed 0, no protection, "
            "its first 20 clients), the knowledge forms added after the table above among "
            "them:",
            "",
            "| knowledge form | reconstructions | PSNR, closest image (dB) | SSIM, closest | "
            "PSNR, class mean (dB) |",
            "|---|---|---|---|---|",
            *form_rows(seed0["rows"]["none"]["forms"]),
        ]
    lines += [
        "",
        f"Privacy against utility: every uploaded vector clipped to L2 norm {doc['clip']:g} "
        "(`privacy.clip`), Gaussian noise σ = z × clip per element (`privacy.noise` = z):",
        "",
        "| protection | seeds | accuracy (last) | PSNR entangled (dB) | PSNR prototype (dB) |",
        "|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        acc = r["accuracy-last"]
        mean = statistics.fmean(acc)
        std = statistics.stdev(acc) if len(acc) > 1 else 0.0
        label = "none" if name == "none" else f"clip {doc['clip']:g}, z = {name[1:]}"
        lines.append(
            f"| {label} | {len(acc)} | {mean:.4f}"
            + (f" ± {std:.4f}" if len(acc) > 1 else "")
            + f" | {r['forms']['entangled']['psnr_closest']:.2f} | "
            f"{r['forms']['prototype']['psnr_closest']:.2f} |"
        )
    if (DOCS / "privacy-grid.png").exists():
        lines += [
            "",
            "One client (seed 0, partition 0, no protection): each form's reconstruction (top) "
            "and the nearest real training image (bottom):",
            "",
            "![privacy grid](docs/results/privacy-grid.png)",
        ]
    return "\n".join(lines) + "\n"


def faults_section() -> str:
    doc = load("faults.json")
    if not isinstance(doc, dict):
        return ""
    lines = [
        f"`python -m benchmarks.faults`: {doc['nodes']} clients, {doc['rounds']} rounds, "
        f"Fashion-MNIST `data.fraction={doc.get('fraction', 0.2):g}`, Dirichlet 0.5, the same "
        "partition and seed in "
        "every row; 20 % of the clients (partitions 0, 5, 10, 15) send the hostile kind in "
        "every round (or crash: no reply; the straggler: partition 0's reply comes after "
        "`round-timeout`); the server killed at the start of round 5 and resumed.",
        "",
        "| algorithm | fault | rounds completed | replies rejected (by reason) | missing replies | "
        "global finite | accuracy (last) | clean run | per-round metrics = clean |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        if r["row"] in ATTACK_ROWS or r["row"].endswith(", robust"):
            continue  # attack_section
        rejected = ", ".join(f"{k} {v}" for k, v in r["rejected"].items()) or "–"
        lines.append(
            f"| {r['algorithm']} | {r['row']} | {r['rounds-completed']} | {rejected} | "
            f"{r['missing']} | {'yes' if r['finite'] else '**no**'} | {r['accuracy']:.4f} | "
            f"{r['accuracy-clean']:.4f} | {'yes' if r['equals-clean'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


ATTACK_ROWS = (
    "1e6-scaled (one client)",
    "sign-flipped",
    "crafted push",
    "wrong-class prototypes",
)
"""The finite-poison rows of ``benchmarks/faults.py`` (each also ``..., robust``)."""


ATTACK_COLUMNS = (
    "clean",
    "clean, robust",
    "1e6-scaled (one client)",
    "sign-flipped",
    "sign-flipped, robust",
    "crafted push",
    "crafted push, robust",
    "wrong-class prototypes",
    "wrong-class prototypes, robust",
)


def attack_section() -> str:
    """The finite-poison rows: accuracy per algorithm and attack, with the defaults
    and (where it applies) with direction screening, in points against the clean run."""
    doc = load("faults.json")
    if not isinstance(doc, dict):
        return ""
    by = {(r["algorithm"], r["row"]): r for r in doc["rows"]}
    algorithms = list(dict.fromkeys(r["algorithm"] for r in doc["rows"]))
    algorithms = [al for al in algorithms if any((al, a) in by for a in ATTACK_ROWS)]
    if not algorithms:
        return ""

    def cell(r: dict | None) -> str:
        if r is None:
            return "–"
        delta = 100 * (r["accuracy"] - r["accuracy-clean"])
        rejected = sum(
            v
            for k, v in r["rejected"].items()
            if k in ("robust.max-norm-ratio", "update direction", "class screening")
        )
        text = f"{r['accuracy']:.3f} ({delta:+.1f})" if r["finite"] else "**non-finite**"
        return text + (f", {rejected} rejected" if rejected else "")

    lines = [
        f"`python -m benchmarks.faults --attacks`: the same {doc['nodes']} clients, "
        f"{doc['rounds']} rounds and partition as the table above. Accuracy (last round) "
        "and, in brackets, points against the clean run; `n rejected`: replies rejected "
        "over the run by `robust.max-norm-ratio` or `robust.min-cosine`, or replies with "
        "prototypes dropped by `robust.prototypes`. " + attack_options(doc) + " `–`: not "
        "applicable.",
        "",
        "| algorithm | " + " | ".join(ATTACK_COLUMNS) + " |",
        "|---|" + "---|" * len(ATTACK_COLUMNS),
    ]
    for al in algorithms:
        cells = [cell(by.get((al, c))) for c in ATTACK_COLUMNS]
        lines.append(f"| {al} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def attack_options(doc: dict) -> str:
    """What the attack table's defaults and ``robust`` columns ran with, from the
    archive (``defaults`` and ``robust-options`` of ``faults.json``)."""

    def setting(key: str, value: object) -> str:
        return f"`{key} = {json.dumps(value)}`"

    shown = ("robust.max-norm-ratio", "robust.min-cosine", "robust.prototypes")
    defaults = ", ".join(setting(k, doc["defaults"][k]) for k in shown if k in doc["defaults"])
    groups: dict[str, list[str]] = {}
    for algorithm, options in doc.get("robust-options", {}).items():
        text = ", ".join(setting(k, v) for k, v in options.items())
        groups.setdefault(text, []).append(algorithm)
    robust = "; ".join(f"{text} for {', '.join(names)}" for text, names in groups.items())
    return f"Defaults columns: the defaults ({defaults}); `robust` columns: {robust}."


def honest_ratios_section() -> str:
    """``benchmarks/honest_ratios.py``: honest upload sizes over their round's median."""
    doc = load("honest_ratios.json")
    if not isinstance(doc, dict) or not doc.get("rows"):
        return ""
    from benchmarks.honest_ratios import table

    rows = doc["rows"]
    return (
        f"`benchmarks/honest_ratios.py`: every uploading algorithm, seed "
        f"0, no fault, screening off, in the accuracy benchmark's regimes (scarce: "
        f"{REGIMES['scarce']['clients']} clients; practical: "
        f"{REGIMES['practical']['clients']} clients) for the rounds shown; each upload's "
        "size over its round's median (`upload-size-ratio`):\n\n" + table(rows)
    )


def server_cost_section() -> str:
    """``benchmarks/server_cost.py``: CPU and requests per connected node by mode and N."""
    doc = load("server_cost.json")
    if not isinstance(doc, dict) or not doc.get("rows"):
        return ""
    rows = sorted(doc["rows"], key=lambda r: (r["mode"] != "fedhet", r["mode"], r["nodes"]))
    lines = [
        f"`benchmarks/server_cost.py`: a loopback federation (TLS + node "
        f"auth, the SuperLink's state in a database file) of N SuperNodes, "
        f"`algorithm='local'`, Fashion-MNIST `data.fraction=0.05`, "
        f"{rows[0]['rounds']} rounds; idle: {rows[0]['idle-s']:.0f} s once every node has "
        f"been online for {rows[0].get('settle-s', 0):.0f} s. CPU from cgroup `cpuacct` "
        "groups per role (exact, ended processes included); cores = CPU s / wall s. "
        "`fedhet`: the defaults; `fast`: fedhet's earlier fixed fast polling; `stock`: "
        "Flower's own SuperNode, SuperExec and grid intervals (a process per message).",
        "",
        "| mode | N | SuperLink cores per node, active / idle | SuperLink + ServerApp CPU s "
        "per node-round | node (SuperNode + executor) cores, active / idle | ClientApp "
        "tasks CPU s per node-round | round overhead s | SuperLink requests per node-round "
        "| nodes per server core at 30 s / 300 s rounds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r["per-node"]
        req = sum(p["requests-per-node-round"].values())
        lines.append(
            f"| {r['mode']} | {r['nodes']} | {p['superlink-active-core-per-node']:.4f} / "
            f"{p['superlink-idle-core-per-node']:.4f} | {p['server-cpu-s-per-node-round']:.2f} "
            f"| {p['node-protocol-active-core']:.4f} / {p['node-protocol-idle-core']:.4f} "
            f"| {p['task-cpu-s-per-node-round']:.2f} | {r['median-round-overhead-s']:.2f} "
            f"| {req:.1f} | {r['carried'][0]:.0f} / {r['carried'][1]:.0f} |"
        )
    biggest = max(r["nodes"] for r in rows)
    kinds = sorted(
        {k for r in rows if r["nodes"] == biggest for k in r["per-node"]["requests-per-node-round"]}
    )
    modes = [r for r in rows if r["nodes"] == biggest]
    lines += [
        "",
        f"SuperLink requests per node-round by kind at N = {biggest} (`fleet/`: from the "
        "SuperNodes; `runtime/`: from the ServerApp and the SuperLink's own SuperExec; "
        "`control/`: `flwr run`), and the SuperLink's CPU per request:",
        "",
        "| kind | " + " | ".join(r["mode"] for r in modes) + " |",
        "|---|" + "---|" * len(modes),
    ]
    for kind in kinds:
        cells = [f"{r['per-node']['requests-per-node-round'].get(kind, 0):.2f}" for r in modes]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    ms = [r["per-node"]["superlink-cpu-ms-per-request"] for r in modes]
    lines.append(
        "| SuperLink CPU ms per request, active / idle | "
        + " | ".join(f"{m['active']:.1f} / {m['idle']:.1f}" for m in ms)
        + " |"
    )
    lines += ["", "![server CPU against N](results/server_cost.png)", ""]
    from benchmarks.server_cost import steady_table

    steady = steady_table(rows)
    if steady:
        lines += [
            "**Steady state** (start-up excluded): CPU per role and SuperLink requests from "
            "the end of round 1 to the end of the run, per node-round; `memory`: the "
            "defaults with the SuperLink's state in memory; `separate`: `eval-mode = "
            '"separate"` (an evaluation message of its own every round); nodes per server '
            "core from the steady CPU and the idle cost (rows measured before the steady "
            "window existed are not in it). Goals: "
            "SuperLink + ServerApp ≤ 0.3 CPU s per node-round with the defaults, ≤ 0.15 "
            "with the state in memory; SuperNode + executor ≤ 0.15.",
            "",
            steady.rstrip(),
            "",
        ]
    return "\n".join(lines) + "\n"


def links_section() -> str:
    """``benchmarks/links.py``: round trips per node-round, bytes-limited rounds and
    requests, by variant and eval-mode (docs/results/links.json)."""
    from benchmarks.links import describe, requests_table, summarise, table

    doc = load("links.json")
    if not isinstance(doc, dict) or not doc.get("rows"):
        return ""
    summary = summarise(doc["rows"])
    text = describe(doc["rows"]) + "\n\n" + table(summary) + "\n" + requests_table(summary)
    cuts = load("links-cuts.json")
    if isinstance(cuts, dict) and cuts.get("rows"):
        rows = cuts["rows"]
        text += (
            f"\nWhat each cut gave, alone (`python -m benchmarks.links --rtts 0,1000 "
            f"--rate-mbps 0 --rounds {rows[0]['rounds']} --variants before,objects,confirm,"
            "fedhet --eval-modes with-train --algorithms lgfedavg --out "
            "benchmarks/out/links-cuts.json`; a longer delay and more rounds than above, so "
            "that a round trip stands out of the noise):\n\n" + table(summarise(rows))
        )
    return text


def replace_block(text: str, tag: str, body: str) -> str:
    pattern = re.compile(rf"(<!-- results:{tag} -->\n).*?(<!-- /results:{tag} -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"no <!-- results:{tag} --> block")
    return pattern.sub(lambda m: m.group(1) + body + m.group(2), text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--readme", action="store_true")
    args = ap.parse_args()
    DOCS.mkdir(parents=True, exist_ok=True)
    print(f"archived {archive()} new or changed runs under {ARCHIVE.relative_to(ROOT)}")
    archive_timings()
    RESULTS_PAGE.write_text(results_page())
    print(f"wrote {RESULTS_PAGE.relative_to(ROOT)}")
    names = sorted({s.name for rows in SUITES.values() for s in rows} | {"local", "lgfedavg"})
    index = {
        reg: {
            n: [
                {
                    **{k: v for k, v in e.summary.items() if k != "nodes"},
                    "seed": e.seed,
                    "bytes-up-per-client-round": e.up,
                    "bytes-down-per-client-round": e.down,
                }
                for e in entries(reg, n)
            ]
            for n in names
            if entries(reg, n)
        }
        for reg in REGIMES
    }
    SUMMARY.write_text(json.dumps(index, indent=1))
    sections = {
        "summary": summary_section(),
        "overhead": overhead_section(),
        "fedara-cost": fedara_cost_section(),
        "server-step": server_step_section(),
        "deployment": deployment_section(),
        "scale": scale_section(),
        "privacy": privacy_section(),
        "faults": faults_section(),
        "attacks": attack_section(),
        "server-cost": server_cost_section(),
        "links": links_section(),
        "honest-ratios": honest_ratios_section(),
        "profiles": profiles_section(),
    }
    for tag, text in sections.items():
        print(text or f"({tag}: no measurement archived; its block left as it is)\n")
    if args.readme:
        write_blocks({tag: body for tag, body in sections.items() if body})


BLOCK_FILES = (
    "README.md",
    "docs/robustness.md",
    "docs/results/methods.md",
    "docs/deployment.md",
    "docs/privacy.md",
)
"""Where the ``<!-- results:TAG -->`` blocks live: the README's summary, the rest in docs/."""


def write_blocks(bodies: dict[str, str]) -> None:
    """Replace each block in the file that holds it; a block found nowhere is an error."""
    left = dict(bodies)
    for name in BLOCK_FILES:
        path = ROOT / name
        text = path.read_text()
        for tag in [t for t in left if f"<!-- results:{t} -->" in text]:
            text = replace_block(text, tag, left.pop(tag))
        path.write_text(text)
    if left:
        raise SystemExit(f"no file of {BLOCK_FILES} has the blocks {sorted(left)}")


if __name__ == "__main__":
    main()
