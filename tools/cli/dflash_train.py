"""The `dflash-train` console script: train/cli.py's commands, with the target model available to
`eval --target` (real speculative decoding).

train/ never imports extract/ (house rule); tools/ may import both. So this entry point hands
train.cli a factory that builds extract's target model as a verifier (tools/cli/verifier.py,
imported only when --target is used, so the other commands start as fast as before), as click's
context object (train.cli.EntryPoint): an argument of this one run, no process-wide state.
`python -m train.cli` runs the same commands without it.
"""

from __future__ import annotations

from train.cli import EntryPoint
from train.cli import main as train_cli


def _target_verifier(target_dir, tap_layer_ids, device, dtype):
    from tools.cli.verifier import target_verifier

    return target_verifier(target_dir, tap_layer_ids, device, dtype)


def _prompt_renderer(target_dir, thinking, template_kwargs):
    from tools.cli.prompts import prompt_renderer

    return prompt_renderer(target_dir, thinking, template_kwargs)


def entry_point() -> EntryPoint:
    """What this console script gives train.cli's commands."""
    return EntryPoint(verifier_factory=_target_verifier, prompt_renderer=_prompt_renderer)


def main() -> None:
    train_cli.main(obj=entry_point())


if __name__ == "__main__":
    main()
