"""Sampling with causal routing and per-layer sparse KV caches.

    python -m mode.generate --checkpoint RUN_DIR_or_checkpoint.pt --prompt "def " \
        [--max-new-tokens N --temperature T --top-k K --top-p P --greedy --seed S]
    python -m mode.generate --checkpoint RUN_DIR --prompt-ids "12 7 99"   # token ids in, ids out

Text prompts work for byte-level models (the text's UTF-8 bytes are the tokens) and for models
trained on a folder `python -m mode.data prepare` wrote: its tokenizer.json encodes the prompt and
decodes the output (--tokenizer names another one, e.g. where the data folder has moved).

Python API: `generate(model, prompts, ...)` for a batch of prompts (token lists or text), and
`Decoder` (mode/inference/decoder.py) for prefill / decode steps with logits.
A routed layer decides per token, causally, whether the token goes through it, and caches only
the tokens it processed; see mode/inference/decoder.py for how prefill and the two decode steps
run every block through its one incremental method.
"""
from __future__ import annotations

from mode.cli import finish, quiet_start, started

quiet_start(__name__)  # before torch: Ctrl-C while it imports ends with one line

import argparse
import math
import re
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import Tensor

from mode.checkpoint import load_model
from mode.config import seed_problem
from mode.data.meta import prepared_folder
from mode.data.tokenizer import TextTokenizer, load_tokenizer
from mode.inference.decoder import DECODE_SDPA_BACKENDS, ROUTED_ROWS, WEIGHTS_REPLACED, Decoder, layer_step
from mode.layers.kv_cache import LayerCache
from mode.model import LanguageModel
from mode.utils import pick_device

__all__ = [
    "DECODE_SDPA_BACKENDS", "ROUTED_ROWS", "Decoder", "LayerCache", "decode_tokens", "generate", "layer_step", "main",
    "sample",
]


# ----------------------------------------------------------------------------- sampling
def check_sampling(temperature: float, top_k: int, top_p: float, max_new_tokens: int) -> None:
    if not (math.isfinite(temperature) and temperature >= 0):  # NaN fails every comparison
        raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")


def sample(logits: Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None) -> Tensor:
    """logits (B, V) -> tokens (B,): greedy at temperature 0, else top-k then nucleus (top-p) sampling."""
    if temperature == 0:
        return logits.argmax(-1)
    # Shifted so the largest is 0 before dividing: a tiny temperature then sends the others to -inf
    # (greedy in the limit) instead of every logit to +-inf and the softmax to NaN.
    logits = logits.float()
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # keep the smallest prefix with mass >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class HostTokens:
    """A step's sampled tokens (B,) on their way to the host without a sync: copied into pinned memory
    behind the step's kernels on a GPU; read with values(), which waits for that copy alone."""

    def __init__(self, tokens: Tensor) -> None:
        self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=tokens.is_cuda)
        self.host.copy_(tokens, non_blocking=tokens.is_cuda)
        self.copied = None
        if tokens.is_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record(torch.cuda.current_stream(tokens.device))

    def values(self) -> list[int]:
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()


def decode_tokens(decoder: Decoder, logits: Tensor, room: Sequence[int], stops: set[int],
                  draw: Callable[[Tensor], Tensor], read_ahead: bool = True) -> list[list[int]]:
    """Each row's new tokens after its prefill's logits (B, V): at most room[i], ending before a stop token.

    read_ahead: the host reads step t's tokens while the device computes step t + 1, so the device
    never waits on the host's bookkeeping. Room runs out at a step the host knows ahead; a stop
    token is seen a step late, so its row computes one step more, whose token is dropped (the row's
    cache is never read again, and the step stays inside the decoder's max_len). False: the host
    reads each step's tokens before it queues the next (the device idles meanwhile). draw: logits
    -> tokens (B,), on the device; called once a step either way, so a seeded draw samples alike."""
    outputs: list[list[int]] = [[] for _ in room]
    done = [r <= 0 for r in room]  # stopped (as far as the host has read) or out of room

    def read(tokens: HostTokens) -> None:
        for i, token in enumerate(tokens.values()):
            if done[i]:
                continue
            if token in stops:
                done[i] = True
                continue
            outputs[i].append(token)
            done[i] = len(outputs[i]) >= room[i]

    sampled = draw(logits)  # (B,) on the device
    unread, drawn = HostTokens(sampled), 1  # drawn: tokens sampled a row so far
    while True:
        if not read_ahead:
            read(unread)
        # the rows that want a token after the last one drawn: not stopped, with room for it
        wanted = [not done[i] and drawn < room[i] for i in range(len(room))]
        ahead = None
        if any(wanted):  # queue the next step (before reading the last one's tokens, read ahead)
            sampled = draw(decoder.step(sampled, torch.tensor(wanted)))
            ahead = HostTokens(sampled)
        if read_ahead:
            read(unread)
        if ahead is None or all(done):
            return outputs
        unread, drawn = ahead, drawn + 1


def encode_text(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode_bytes(tokens: Sequence[int]) -> str:
    return bytes(t for t in tokens if 0 <= t < 256).decode("utf-8", errors="replace")


def is_byte_level(model: LanguageModel) -> bool:
    """Whether the model's token ids are UTF-8 bytes (text in, text out).

    A model trained on a pre-tokenized .bin (data.source: tokens) reads ids of some other
    tokenizer even at vocab_size 256, and a vocabulary other than 256 cannot be bytes.
    """
    config = model.config
    return config.data.source != "tokens" and config.model.vocab_size == 256


def _token_model(model: LanguageModel) -> str:
    """Why a model is not byte-level, for error messages."""
    config = model.config
    return (f"this model reads token ids (data.source {config.data.source!r}, "
            f"model.vocab_size {config.model.vocab_size}), not text")


def run_tokenizer(model: LanguageModel) -> TextTokenizer | None:
    """The tokenizer of the prepared folder the model was trained on (its data.path's tokenizer.json), or
    None where its data was not a prepared folder or that folder is no longer there."""
    folder = prepared_folder(model.config)
    return None if folder is None else load_tokenizer(folder, "data.path")


def text_tokenizer(model: LanguageModel, tokenizer: TextTokenizer | None) -> TextTokenizer | None:
    """The tokenizer text prompts go through: None for a byte-level model (its tokens are UTF-8 bytes), else
    `tokenizer` or the run's own (run_tokenizer); a ValueError where there is none or it does not fit."""
    if is_byte_level(model):
        if tokenizer is not None:
            raise ValueError(f"tokenizer {tokenizer.path}: this model is byte-level (its tokens are UTF-8 bytes); "
                             "give no tokenizer")
        return None
    tokenizer = tokenizer or run_tokenizer(model)
    if tokenizer is None:
        return None
    vocab = model.config.model.vocab_size
    if tokenizer.vocab_size > vocab:
        raise ValueError(f"tokenizer {tokenizer.path}: its {tokenizer.vocab_size} tokens do not fit this model's "
                         f"model.vocab_size ({vocab}): not the tokenizer it was trained with")
    return tokenizer


def continuation(tokenizer: TextTokenizer, prompt: Sequence[int], new: Sequence[int]) -> str:
    """The text of `new` after `prompt`: decoded together (a character may span the two) less the prompt's text."""
    head, whole = tokenizer.decode(prompt), tokenizer.decode([*prompt, *new])
    return whole[len(head):] if whole.startswith(head) else tokenizer.decode(new)


def check_decoder(decoder: Decoder, model: LanguageModel, batch: int, max_len: int) -> None:
    """A ValueError naming generate's decoder argument where the decoder cannot serve this call."""
    if decoder.model is not model:
        raise ValueError("decoder: it was built for another model (Decoder(model, ...) with the model given here)")
    if decoder.batch != batch:
        raise ValueError(f"decoder: it was built for batch {decoder.batch}, but {batch} prompts were given")
    if decoder.weights_replaced():
        raise ValueError(f"decoder: {WEIGHTS_REPLACED}")
    if decoder.max_len < max_len:
        raise ValueError(f"decoder: its max_len {decoder.max_len} is below the {max_len} this call needs "
                         "(the longest prompt and max_new_tokens, within model.max_seq_len)")


def generate(
    model: LanguageModel,
    prompts: Sequence[Sequence[int]] | Sequence[str],
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_tokens: Sequence[int] = (),
    seed: int | None = None,
    compile: bool = False,
    tokenizer: TextTokenizer | None = None,
    decoder: Decoder | None = None,
) -> list[list[int]] | list[str]:
    """Sample continuations of a batch of prompts; returns the new tokens (or text for text prompts).

    Prompts are token lists or strings: UTF-8 bytes for a byte-level model, else encoded by `tokenizer`
    (default: the tokenizer of the prepared folder the model trained on). Temperature 0 is greedy. A row
    stops at a stop token (not included in its output), after max_new_tokens, or when it
    reaches the context window (model.max_seq_len). compile: torch.compile the static decode
    step (Decoder(compile=True); worth its compile time for long generations).
    decoder: a Decoder of this model for len(prompts) rows, reset and reused (its settings, compile
    included, stand): its caches and its captured CUDA graph serve call after call, where a call
    without one builds a decoder and captures its graph anew. Its max_len must hold the longest
    prompt and max_new_tokens (or reach model.max_seq_len).
    """
    check_sampling(temperature, top_k, top_p, max_new_tokens)
    if isinstance(prompts, str) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of prompts (token lists or strings)")
    as_text = all(isinstance(p, str) for p in prompts)
    if any(isinstance(p, str) for p in prompts):
        tokenizer = text_tokenizer(model, tokenizer)
        if tokenizer is None and not is_byte_level(model):
            # Byte-encoding the text would feed ids of the wrong tokenizer, and decode_bytes would
            # drop every generated id >= 256: the caller would see the prompt and nothing else.
            raise ValueError(f"text prompts need a byte-level model or a tokenizer; {_token_model(model)}: "
                             "give token lists or the tokenizer it was trained with")
    encode = tokenizer.encode if tokenizer is not None else encode_text
    token_prompts = [encode(p) if isinstance(p, str) else list(p) for p in prompts]
    cfg = model.config.model
    for i, p in enumerate(token_prompts):
        if len(p) == 0:
            raise ValueError(f"prompts[{i}] is empty: a prompt needs at least one token")
        if len(p) > cfg.max_seq_len:
            raise ValueError(
                f"prompts[{i}] has {len(p)} tokens, longer than the context window model.max_seq_len ({cfg.max_seq_len})"
            )
        bad = [t for t in p if not 0 <= int(t) < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompts[{i}] holds token ids outside the vocabulary [0, {cfg.vocab_size}): {bad[:5]}")
    model.check_causal()
    stops = set(int(t) for t in stop_tokens)
    longest = max(len(p) for p in token_prompts)
    max_len = min(cfg.max_seq_len, longest + max_new_tokens)
    was_training = model.training
    model.eval()
    device = model.embed.weight.device
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    if decoder is not None:
        check_decoder(decoder, model, len(token_prompts), max_len)
    try:
        if decoder is None:
            decoder = Decoder(model, len(token_prompts), max_len, routed_rows="masked" if compile else "auto",
                              compile=compile)
        else:
            decoder.reset()
        room = [min(max_new_tokens, cfg.max_seq_len - len(p)) for p in token_prompts]
        outputs: list[list[int]] = [[] for _ in token_prompts]
        if max_new_tokens > 0 and any(r > 0 for r in room):
            draw = lambda logits: sample(logits, temperature, top_k, top_p, generator)  # noqa: E731
            outputs = decode_tokens(decoder, decoder.prefill(token_prompts), room, stops, draw)
    finally:
        model.train(was_training)
    if not as_text:
        return outputs
    if tokenizer is None:
        return [decode_bytes(o) for o in outputs]
    return [continuation(tokenizer, p, o) for p, o in zip(token_prompts, outputs)]


# ----------------------------------------------------------------------------- command line
# The sampling flags' defaults: --greedy (the argmax) makes any other value meaningless.
SAMPLING_DEFAULTS = {"--temperature": 1.0, "--top-k": 0, "--top-p": 1.0}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Sample text from a trained MoD / MoDE model (causal routing).")
    parser.add_argument("--checkpoint", required=True, help="run folder or checkpoint.pt")
    parser.add_argument("--prompt", action="append",
                        help="prompt text (repeat for a batch): byte-level models, or tokenized ones with their tokenizer")
    parser.add_argument(
        "--prompt-ids", action="append",
        help='prompt as token ids, e.g. "12 7 99" or "12,7,99"; the output is ids too (repeat for a batch). '
        "Give --prompt or --prompt-ids, not both",
    )
    parser.add_argument(
        "--tokenizer", type=Path, default=None,
        help="for --prompt on a tokenized model: a tokenizer.json, a Hugging Face model folder or a prepared data "
        "folder (default: the tokenizer of the prepared folder the run trained on)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=SAMPLING_DEFAULTS["--temperature"])
    parser.add_argument("--top-k", type=int, default=SAMPLING_DEFAULTS["--top-k"])
    parser.add_argument("--top-p", type=float, default=SAMPLING_DEFAULTS["--top-p"])
    parser.add_argument("--greedy", action="store_true", help="argmax decoding (temperature 0)")
    parser.add_argument("--seed", type=seed_value, default=None, help="seeds the sampling: 0 to 2**63 - 1")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--compile", action="store_true", help="torch.compile the decode step (pays off on long generations)")
    parser.add_argument(
        "--dtype", default="auto", choices=list(DTYPES),
        help="the weights' dtype while sampling; auto: bfloat16 on a GPU (as training's autocast computes, and what "
        "flash attention's variable-length decode kernel needs), float32 on CPU",
    )
    return parser


def seed_value(text: str) -> int:
    """--seed: an integer in train.seed's range (torch.manual_seed fails past 64 bits with a line naming no flag)."""
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    problem = seed_problem(seed)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{seed} is out of range: a seed {problem}")
    return seed


DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


def sampling_dtype(name: str, device: torch.device) -> torch.dtype:
    """--dtype -> the dtype the model samples in (auto: bfloat16 on CUDA, float32 elsewhere)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def _check_flags(args: argparse.Namespace) -> None:
    """Flag combinations that would otherwise be ignored silently."""
    if (args.prompt is None) == (args.prompt_ids is None):
        raise ValueError("give exactly one of --prompt (text) and --prompt-ids (token ids)")
    if args.tokenizer is not None and args.prompt is None:
        raise ValueError("--tokenizer encodes --prompt text; --prompt-ids are token ids already: drop --tokenizer")
    if args.greedy:
        given = {"--temperature": args.temperature, "--top-k": args.top_k, "--top-p": args.top_p}
        # --temperature 0 is greedy already, so it agrees with --greedy
        clash = [f for f, v in given.items() if v != SAMPLING_DEFAULTS[f] and not (f == "--temperature" and v == 0)]
        if clash:
            raise ValueError(f"--greedy takes the argmax and would ignore {', '.join(clash)}: drop one or the other")
    check_sampling(args.temperature, args.top_k, args.top_p, args.max_new_tokens)


def parse_prompt_ids(value: str, vocab_size: int) -> list[int]:
    """'12 7 99' or '12,7,99' -> [12, 7, 99], each id checked to be in [0, vocab_size)."""
    ids = []
    for part in re.split(r"[\s,]+", value.strip()):
        if not part:  # an empty value: _check_prompt reports it
            continue
        try:
            token = int(part)
        except ValueError:
            raise ValueError(f"--prompt-ids {value!r}: {part!r} is not an integer token id "
                             "(give ids separated by spaces or commas)") from None
        if not 0 <= token < vocab_size:
            raise ValueError(f"--prompt-ids {value!r}: token id {token} is outside the vocabulary "
                             f"[0, {vocab_size}) of this model (model.vocab_size)")
        ids.append(token)
    return ids


def _label(flag: str, index: int, count: int) -> str:
    return flag if count == 1 else f"{flag} #{index + 1}"


def _cli_prompts(args: argparse.Namespace, model: LanguageModel) -> tuple[str, list[list[int]], TextTokenizer | None]:
    """(the flag the prompts came from, the prompts as token lists, the tokenizer of text prompts: None for bytes)."""
    if args.prompt is None:
        return "--prompt-ids", [parse_prompt_ids(v, model.config.model.vocab_size) for v in args.prompt_ids], None
    given = load_tokenizer(args.tokenizer) if args.tokenizer is not None else None
    try:
        tokenizer = text_tokenizer(model, given)
    except ValueError as e:
        raise ValueError(f"--{e}" if given is not None else str(e)) from None  # "--tokenizer PATH: ..."
    if tokenizer is None and not is_byte_level(model):
        raise ValueError(f'--prompt: {_token_model(model)}; give the prompt as --prompt-ids "12 7 99"')
    prompts = []
    for i, text in enumerate(args.prompt):
        try:
            prompts.append(tokenizer.encode(text) if tokenizer is not None else encode_text(text))
        except UnicodeEncodeError:  # bytes the shell passed that are not UTF-8 (kept as surrogates)
            raise ValueError(f"{_label('--prompt', i, len(args.prompt))} is not valid UTF-8 text: give its bytes "
                             'as --prompt-ids "104 105"') from None
    return "--prompt", prompts, tokenizer


def _check_prompt(label: str, tokens: list[int], unit: str, max_seq_len: int, max_new_tokens: int) -> None:
    """Checked here, not only in generate(), so that errors name the flag; and a prompt that fills
    the context window is an error, not an empty sample. unit: what a token is, for the message."""
    if not tokens:
        raise ValueError(f"{label} is empty: a prompt needs at least one token")
    if len(tokens) > max_seq_len:
        raise ValueError(f"{label} has {len(tokens)} {unit}, longer than the context window model.max_seq_len ({max_seq_len})")
    if len(tokens) == max_seq_len and max_new_tokens > 0:
        raise ValueError(f"{label} has {len(tokens)} {unit}, the whole context window model.max_seq_len "
                         f"({max_seq_len}): no room to generate")


def _cut_notice(name: str, prompt_len: int, new: int, max_new_tokens: int, max_seq_len: int) -> str | None:
    """A note when the context window, not --max-new-tokens, ended a sample (None otherwise)."""
    if max_new_tokens <= max_seq_len - prompt_len or new < max_seq_len - prompt_len:
        return None
    return (f"note: {name}generated {new} new tokens, not --max-new-tokens {max_new_tokens}: the prompt "
            f"({prompt_len} tokens) and the output fill the context window model.max_seq_len ({max_seq_len})")


def _print_samples(args: argparse.Namespace, prompts: list[list[int]], outputs: list[list[int]], max_seq_len: int,
                   tokenizer: TextTokenizer | None) -> None:
    """Each prompt and its continuation (text, or ids for --prompt-ids); a header line before each
    sample when there are several, since a text sample can span lines."""
    many = len(prompts) > 1
    for i, (prompt, new) in enumerate(zip(prompts, outputs)):
        if many:
            print(f"--- sample {i + 1} ---")
        if tokenizer is not None:
            print(tokenizer.decode(prompt + new))  # the prompt as the tokenizer reads it back
        elif args.prompt is not None:
            print(args.prompt[i] + decode_bytes(new))
        else:
            print(" ".join(str(t) for t in prompt + new))
        notice = _cut_notice(f"sample {i + 1}: " if many else "", len(prompt), len(new), args.max_new_tokens, max_seq_len)
        if notice:
            print(notice, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    started()
    args = _parser().parse_args(argv)
    try:
        _check_flags(args)
        device = pick_device(args.device, field="--device")
        model = load_model(args.checkpoint, device).to(sampling_dtype(args.dtype, device))
        flag, prompts, tokenizer = _cli_prompts(args, model)
        max_seq_len = model.config.model.max_seq_len
        unit = "UTF-8 bytes" if flag == "--prompt" and tokenizer is None else "tokens"
        for i, p in enumerate(prompts):
            _check_prompt(_label(flag, i, len(prompts)), p, unit, max_seq_len, args.max_new_tokens)
        outputs = generate(
            model, prompts, max_new_tokens=args.max_new_tokens, temperature=0.0 if args.greedy else args.temperature,
            top_k=args.top_k, top_p=args.top_p, seed=args.seed, compile=args.compile,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _print_samples(args, prompts, outputs, max_seq_len, tokenizer)
    return 0


if __name__ == "__main__":
    finish(main())
