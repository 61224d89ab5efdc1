"""python -m mode.hf import|export: see mode/hf/__init__.py."""
from __future__ import annotations

from mode.cli import finish, quiet_start, started

quiet_start(__name__)  # before torch: Ctrl-C while it imports ends with one line

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from mode.hf.convert import FAMILIES, HFError, export_run, import_run  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mode.hf", description="Hugging Face checkpoints in and out of mode.")
    commands = parser.add_subparsers(dest="command", required=True)
    into = commands.add_parser("import", help="a save_pretrained folder -> a mode run folder (config.yaml, checkpoint.pt)")
    into.add_argument("hf_folder", type=Path)
    into.add_argument("run_folder", type=Path, help="a new (or empty) folder")
    into.add_argument("--max-seq-len", type=int, default=None,
                      help="the context to build (default: the model's max_position_embeddings)")
    out = commands.add_parser("export", help="a mode run folder -> a Hugging Face folder")
    out.add_argument("run_folder", type=Path, help="run folder or checkpoint.pt")
    out.add_argument("hf_folder", type=Path, help="a new (or empty) folder")
    out.add_argument("--family", default="llama", choices=FAMILIES,
                     help="llama, mistral, qwen2: dense models; mixtral, qwen2_moe: token-choice MoE models; "
                          "mode: any model (MoD, MoDE), loaded by from_pretrained after `import mode.hf`")
    return parser


def main(argv: list[str] | None = None) -> int:
    started()
    args = _parser().parse_args(argv)
    try:
        if args.command == "import":
            if args.max_seq_len is not None and args.max_seq_len < 2:
                raise HFError(f"--max-seq-len {args.max_seq_len}: must be at least 2")
            config = import_run(args.hf_folder, args.run_folder, args.max_seq_len)
            m = config.model
            print(f"imported {args.hf_folder} into {args.run_folder}: {m.n_layers} layers, d_model {m.d_model}, "
                  f"vocab {m.vocab_size}, context {m.max_seq_len}")
        else:
            export_run(args.run_folder, args.hf_folder, args.family)
            print(f"exported {args.run_folder} to {args.hf_folder} (family {args.family})")
    except (HFError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    finish(main())
