"""Benchmarks of what attn-overlay costs, measured as ratios of runs made side by side.

``python -m scripts.bench`` from the repository root runs every figure and writes a JSON file and
a PNG chart under ``results/`` (git-ignored); ``--smoke`` runs them with tiny repetitions (the
test suite does, so the scripts never rot). See :mod:`scripts.bench.run` for the options.

Figures (goal in brackets; every ratio is per round, summarised as median/min/max):

1. ``python -c pass`` with the startup hook / without the ``.pth`` [<= 1.03]
2. first ``import transformers.generation.utils`` with the overlay / without (information), and
   the time spent applying the patches at that import [<= 5 ms]
3. patched ``prepare_inputs_for_generation`` / 5.20.0's fixed logic / stock, on-device inputs
   and host-side inputs with a nested mask dict [<= 1.05]
4. tiny-model ``generate()`` tokens/s with every patch active / without, nothing to fix [>= 0.99],
   and the decoding-step time ratio [<= 1.01]
5. extra tensor copies per decoding step when dtypes already match [0]
6. GPU only: host-input static-cache ``generate`` / on-device-input one, tokens/s [>= 0.98]
7. extra time per layer and decoding step (cache update + attention call; and, per step, the SDPA
   mask rule, information), overlay applied /
   reverted, min of ``timeit`` repeats, on transformers 5.13.0, 5.18.0, 5.24.0 [<= 1.0 µs]
8. instructions per decoding step under ``valgrind --tool=callgrind``, counted in the decode loop
   only, overlay / without: ratio and extra instructions per layer and step (information)
9. the whole ``generate()`` call under callgrind, per release lane (``--lanes``), mode and depth:
   extra instructions per generated token, overlay - stock [<= 3,000 where nothing fires,
   <= 30,000 with the repetition penalty on a padded batch]; ``--attribute`` leaves each patch out

Figure 4 also gives the decoding-step ratio of a model with 8 layers of hidden size 512 [<= 1.005].

The parent process imports neither torch nor transformers: figures 3-8 run in a fresh worker
interpreter each (``scripts/bench/worker.py``), figures 1-2 in fresh virtual environments.
"""

#: number -> (id, title), the order of the report.
FIGURES = {
    1: ("startup", "interpreter start (python -c pass): startup hook / no hook"),
    2: ("import", "first import of transformers.generation.utils: overlay / without, and patching time"),
    3: ("prepare_inputs", "patched prepare_inputs_for_generation / upstream 5.20.0 logic / stock"),
    4: ("generate", "tiny-model generate(): overlay / without, nothing to fix"),
    5: ("copies", "extra tensor copies per decoding step when dtypes already match"),
    6: ("gpu_host_inputs", "GPU static-cache generate: host-side inputs / on-device inputs (overlay applied)"),
    7: ("per_call", "extra µs per layer and decoding step: cache update + attention call, overlay / reverted"),
    8: ("callgrind", "instructions per decoding step (callgrind, decode loop only): overlay / without"),
    9: ("whole_generate", "whole generate() call, extra instructions per generated token (callgrind): overlay - stock"),
}
