"""The `dflash-train` console script: train/cli.py's commands, with the target model available to
`eval --target` (real speculative decoding).

train/ never imports extract/ (house rule); tools/ may import both. So this entry point registers a
factory that builds extract's target model as a verifier (tools/cli/verifier.py, imported only when
--target is used, so the other commands start as fast as before) and then runs train.cli.main.
"""

from __future__ import annotations

from train.cli import main as _train_main
from train.eval.speculative import register_verifier_factory


def _target_verifier(target_dir, tap_layer_ids, device, dtype):
    from tools.cli.verifier import target_verifier

    return target_verifier(target_dir, tap_layer_ids, device, dtype)


def main() -> None:
    register_verifier_factory(_target_verifier)
    _train_main()


if __name__ == "__main__":
    main()
