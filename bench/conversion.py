"""A pretrained Llama-shaped model converted to MoD and router-tuned: step time and loss.

    python -m bench.conversion            # ~100M parameters (D=768, 12 layers, GQA 12/4 heads), bf16, one GPU
    python -m bench.conversion --tiny     # a CPU smoke run of the same path

Every step is the library's own command, as docs/huggingface.md walks it:
1. `python -m mode.data prepare`: the standard library's sources, a byte-level BPE of --vocab tokens.
2. A randomly initialised `LlamaForCausalLM` of the shape, `save_pretrained` (as if downloaded).
3. `python -m mode.hf import` into a run folder.
4. `python -m mode.train` from the imported weights (`train.init_from`), the same batch and steps:
   the unconverted dense model (all weights), and the model converted to MoD (12.5% on every
   other block, capacity annealed from 1.0 over --anneal steps) trained whole and router-tuned
   (`train.trainable: routers`).
5. `python -m mode.evaluate --data-path` before (the imported model) and after each run.
Step time is the median over the steps after the anneal (tokens/s from metrics.jsonl).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from bench.common import require_cuda_unless_tiny

RUNS = (  # name, block pattern, trainable
    ("dense (unconverted)", ["dense"], "all"),
    ("MoD, all weights", ["dense", "mod"], "all"),
    ("MoD, routers only", ["dense", "mod"], "routers"),
)


def run(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"python -m {' '.join(args)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return out.stdout


def save_random_llama(folder: Path, args: argparse.Namespace) -> int:
    """A random LlamaForCausalLM saved as a Hugging Face folder; its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.width, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, intermediate_size=args.ffn, max_position_embeddings=args.seq,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def train_config(imported: Path, data: Path, out: Path, pattern: list[str], trainable: str,
                 args: argparse.Namespace) -> dict:
    model = yaml.safe_load((imported / "config.yaml").read_text())["model"]
    model["block_pattern"] = pattern
    converted = pattern != ["dense"]
    routing = {"capacity": 0.125, "gate": "identity", "router_bias": True, "causal": "aux_loss"}
    if converted:
        routing["capacity_schedule"] = {"start": 1.0, "steps": args.anneal, "stages": min(4, args.anneal)}
    return {
        "model": {k: v for k, v in model.items() if k != "vocab_size"},  # the prepared data sets it
        "routing": routing,
        "data": {"source": "tokens", "path": str(data), "seq_len": args.seq},
        "train": {
            "init_from": str(imported), "trainable": [trainable], "batch_size": args.batch, "max_steps": args.steps,
            "warmup_steps": min(10, args.steps - 1), "lr": args.lr, "min_lr": args.lr / 10, "log_interval": 1,
            "eval_interval": args.steps, "eval_batches": 4, "checkpoint_interval": args.steps,
            "out_dir": str(out), "progress": False, "device": args.device,
        },
    }


def step_ms(run_dir: Path, after: int, tokens_per_step: int) -> tuple[float, float]:
    """(median step ms, median tokens/s) over the logged steps after `after`."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r and r["step"] > after]
    rate = statistics.median(rates)
    return tokens_per_step / rate * 1e3, rate


def evaluate(run_dir: Path, data: Path, batches: int, device: str) -> float:
    out = run("mode.evaluate", str(run_dir), "--batches", str(batches), "--data-path", str(data), "--device", device)
    return json.loads(out)["val_loss"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=2560)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--anneal", type=int, default=50, help="steps over which capacity goes from 1.0 to 0.125")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-batches", type=int, default=20)
    parser.add_argument("--work", type=Path, default=None, help="keep the folders here (default: a temporary one)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run at a small shape")
    args = parser.parse_args(argv)
    require_cuda_unless_tiny(parser, args)
    args.device = "cpu" if args.tiny else "cuda"
    prepare = ["--max-bytes", "400000"] if args.tiny else []
    if args.tiny:
        args.width, args.layers, args.heads, args.kv_heads, args.ffn, args.vocab = 64, 2, 4, 2, 128, 320
        args.seq, args.batch, args.steps, args.anneal, args.eval_batches = 64, 4, 6, 2, 2
    with tempfile.TemporaryDirectory(prefix="bench-conversion-") as scratch:
        work = args.work or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        data, hf, imported = work / "data", work / "hf_llama", work / "imported"
        run("mode.data", "prepare", "--out", str(data), "--train-bpe", "--vocab-size", str(args.vocab), *prepare)
        params = save_random_llama(hf, args)
        run("mode.hf", "import", str(hf), str(imported), "--max-seq-len", str(args.seq))
        before = evaluate(imported, data, args.eval_batches, args.device)
        rows, dense_ms = [], None
        for i, (name, pattern, trainable) in enumerate(RUNS):
            out = work / f"run{i}"
            config = work / f"run{i}.yaml"
            config.write_text(yaml.safe_dump(train_config(imported, data, out, pattern, trainable, args)))
            run("mode.train", "--config", str(config))
            ms, rate = step_ms(out, args.anneal, args.batch * args.seq)
            dense_ms = dense_ms or ms
            after = evaluate(out, data, args.eval_batches, args.device)
            rows.append(f"| {name} | {trainable} | {ms:.1f} | {rate:,.0f} | {ms / dense_ms:.2f} | {before:.3f} | {after:.3f} |")
    card = "CPU"
    if not args.tiny:
        import torch

        card = torch.cuda.get_device_name()
    print(f"\nConversion, {card}: random Llama of {params / 1e6:.1f}M parameters (D={args.width}, {args.layers} layers, "
          f"{args.heads}/{args.kv_heads} heads, ffn {args.ffn}, vocab {args.vocab}), batch {args.batch} x {args.seq}, "
          f"{args.steps} steps (lr {args.lr}); MoD: every other block, capacity 0.125 after {args.anneal} annealed "
          f"steps from 1.0; step time after the anneal; loss: mode.evaluate over {args.eval_batches} batches\n")
    print("| run | trainable | step ms | tokens/s | x dense step time | val loss before | val loss after |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
