"""How well does the draft's own confidence predict acceptance? (vLLM-free, Hugging Face only)

    .venv/bin/python scripts/draft_calibration.py [ZOO_DIR]

Teacher-forces the zoo's target and draft over windows of the held-out files and, per bin
of the draft's top probability, prints how often the draft's argmax equals the target's
(greedy acceptance) and the mean of sum(min(p, q)) (acceptance at temperature 1), then the
temperature-1 acceptance for other draft temperatures. The draft proposer's stopping rule
leans on this relation (specplugin/adaptive/draft_rule.py), so it is worth knowing per pair.
"""

import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from specplugin.bench.workloads import source_from_zoo
from specplugin.zoo import zoo_path

EDGES = [0, .05, .1, .2, .3, .4, .5, .6, .7, .8, .9, 1.01]


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else zoo_path("target").parent
    stream = source_from_zoo(root).stream
    target = AutoModelForCausalLM.from_pretrained(root / "target", dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(root / "draft", dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    target_probs, draft_logits = [], []
    with torch.no_grad():
        for start in rng.choice(len(stream) - 300, 40):
            ids = torch.tensor(stream[start:start + 256])[None]
            target_probs.append(target(ids).logits[0].softmax(-1))
            draft_logits.append(draft(ids).logits[0])
    p, logits = torch.cat(target_probs), torch.cat(draft_logits)
    q = logits.softmax(-1)
    conf = q.max(-1).values
    greedy = (q.argmax(-1) == p.argmax(-1)).float()
    sampled = torch.minimum(p, q).sum(-1)
    print(f"{len(conf)} positions: greedy acceptance {greedy.mean():.3f}, "
          f"temperature-1 acceptance {sampled.mean():.3f}")
    for lo, hi in zip(EDGES, EDGES[1:]):
        m = (conf >= lo) & (conf < hi)
        if m.any():
            print(f"draft top prob [{lo:.2f}, {hi:.2f}): {m.float().mean():6.1%} of positions, "
                  f"greedy acceptance {greedy[m].mean():.3f}, temperature 1 {sampled[m].mean():.3f}")
    for tau in (0.7, 0.8, 0.9, 1.0, 1.1, 1.3):
        accept = torch.minimum(p, (logits / tau).softmax(-1)).sum(-1).mean()
        print(f"draft sampled at temperature {tau}: temperature-1 acceptance {accept:.4f}")


if __name__ == "__main__":
    main()
