"""Train a transformers Llama with autoshard under torchrun, as people train: weights from a safetensors
checkpoint into a model that is never whole on any rank, AdamW with warm-up and cosine decay, bf16 mixed
precision (float32 masters; or --mixed-precision fp16 with loss scaling), gradient clipping by the global norm, gradient accumulation, dropout, a
torch.distributed.checkpoint save mid-run that a second run resumes from, one global loss and tokens/s
per step (a progress bar on rank 0).

    torchrun --nproc-per-node 4 examples/train_llm.py --mesh 2,2 --axis-names dp,tp --steps 20 --save-at 10 \\
        --out /tmp/llm
    torchrun --nproc-per-node 4 examples/train_llm.py --mesh 2,2 --axis-names dp,tp --steps 20 --out /tmp/llm \\
        --resume    # continues from step 10: the same losses as the uninterrupted run

The first run writes `OUT/pretrained` (a seeded Llama saved with save_pretrained, standing in for a
downloaded checkpoint); `OUT/losses.json` holds {step: loss} of every step a run trained.
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

import autoshard
from autoshard.runtime.launch import (
    check_fingerprint,
    communicator_for,
    init_distributed,
)
from autoshard.runtime.loss_scale import LossScaler, optimizer_step
from autoshard.zoo.transformers_hints import HINTS


def transformers_quietly():
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return transformers


def llama_config(args):
    return transformers_quietly().LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=2 * args.dim, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.heads // 2, max_position_embeddings=args.seq,
        attention_dropout=args.dropout, tie_word_embeddings=False, use_cache=False)


def llama_class():
    """LlamaForCausalLM whose forward takes (ids, labels) positionally (its parameter names unchanged)."""
    class Llama(transformers_quietly().LlamaForCausalLM):
        def forward(self, ids, labels):
            return super().forward(input_ids=ids, labels=labels)
    return Llama


def next_token_loss(outputs, ids, labels):
    return outputs.loss


def write_pretrained(args, path):
    """A seeded Llama saved as safetensors (rank 0 only: no other rank ever builds real weights)."""
    torch.manual_seed(0)
    transformers_quietly().LlamaForCausalLM(llama_config(args)).save_pretrained(path, safe_serialization=True)


def batch(args, step: int, micro: int) -> torch.Tensor:
    """Global batch of token ids for (step, accumulation pass): the same on every rank and after a restart.
    Each row counts up from a random start (mod the vocabulary): a pattern the model can learn."""
    generator = torch.Generator().manual_seed(1000 * step + micro)
    start = torch.randint(3, args.vocab, (args.global_batch // args.accumulate, 1), generator=generator)
    return 3 + (start + torch.arange(args.seq)) % (args.vocab - 3)


def schedule(args):
    def factor(step):
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))
    return factor


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mesh", default="2,2")
    parser.add_argument("--axis-names", default="dp,tp")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-at", type=int, default=None, help="save a checkpoint after this many steps")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    parser.add_argument("--out", required=True)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--mixed-precision", default="bf16", choices=("bf16", "fp16", "none"))
    args = parser.parse_args()
    mesh = tuple(int(s) for s in args.mesh.split(","))
    names = tuple(args.axis_names.split(","))

    init_distributed()
    rank = dist.get_rank()
    pretrained = os.path.join(args.out, "pretrained")
    if rank == 0 and not os.path.exists(pretrained):
        write_pretrained(args, pretrained)
    dist.barrier()

    with torch.device("meta"):  # no rank ever holds the whole model
        model = llama_class()(llama_config(args))
    model.train()
    example = batch(args, 0, 0).to("meta")
    hints = {k: {a: p for a, p in v.items() if a in names} for k, v in HINTS["llama"].items()}  # Megatron on tp
    hints = {k: v for k, v in hints.items() if v}  # a mesh without tp (or dp) drops those hints
    prog = autoshard.parallelize(model, mesh, (example, example), hints=hints, loss_fn=next_token_loss,
                                 axis_names=names, seed=0,
                                 mixed_precision=None if args.mixed_precision == "none" else args.mixed_precision)
    comm = communicator_for(prog.mesh)
    check_fingerprint(comm, prog.plan.fingerprint)
    module = prog.module(rank, comm, weights=pretrained, strict=False)  # this rank's slices only
    opt = torch.optim.AdamW(module.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(args))
    scaler = LossScaler(module) if args.mixed_precision == "fp16" else None  # GradScaler, agreed by all ranks
    checkpoint, trainer_file = os.path.join(args.out, "checkpoint"), os.path.join(args.out, "checkpoint", "trainer.json")
    start = 0
    if args.resume:
        autoshard.load_checkpoint(checkpoint, module, opt)
        with open(trainer_file, encoding="utf-8") as handle:
            saved = json.load(handle)
        start = saved["step"]
        sched.load_state_dict(saved["scheduler"])
        for group, lr in zip(opt.param_groups, sched.get_last_lr()):  # the checkpoint holds tensors only
            group["lr"] = lr
        module.rng.load_state_dict({"seed": saved["rng"]["seed"], "step": saved["rng"]["step"]})
        if scaler is not None:
            scaler.load_state_dict(saved["loss_scale"])

    losses = {}
    rows = prog.local_batch(rank, args.global_batch // args.accumulate)  # this rank loads only these rows
    bar = tqdm(range(start, args.steps), disable=rank != 0, desc="train", unit="step")
    for step in bar:
        began = time.perf_counter()
        total = 0.0
        for micro in range(args.accumulate):
            ids = batch(args, step, micro)[rows]
            loss, _ = module(*module.local_inputs_of_rows(ids, ids))  # causal LM: the model shifts the labels
            (loss / args.accumulate if scaler is None else scaler.scale(loss / args.accumulate)).backward()
            total += float(module.global_loss(loss.detach().float())) / args.accumulate
        module.sync_grads()
        if scaler is not None:
            scaler.unscale_()  # clip the true gradients
        norm = module.clip_grad_norm_(args.clip)
        optimizer_step(opt, scaler)  # fp16: skipped on every rank when any rank overflowed
        sched.step()
        opt.zero_grad()
        losses[step] = total
        tokens = args.global_batch * args.seq / (time.perf_counter() - began)
        bar.set_postfix(loss=f"{total:.4f}", grad_norm=f"{float(norm):.3f}", tokens_per_s=f"{tokens:.0f}")
        if rank == 0:
            tqdm.write(f"step {step}: loss {total:.6f} grad norm {float(norm):.4f} tokens/s {tokens:.0f}")
        if args.save_at is not None and step + 1 == args.save_at:
            autoshard.save_checkpoint(checkpoint, module, opt)  # collective: every rank writes its shards
            if rank == 0:
                with open(trainer_file, "w", encoding="utf-8") as handle:
                    json.dump({"step": step + 1, "scheduler": sched.state_dict(),
                               "rng": {k: v for k, v in module.rng.state_dict().items() if k != "exact"},
                               "loss_scale": scaler.state_dict() if scaler is not None else None}, handle)
            dist.barrier()
    if rank == 0:
        with open(os.path.join(args.out, "losses.json" if not args.resume else "losses_resumed.json"), "w",
                  encoding="utf-8") as handle:
            json.dump({str(k): v for k, v in losses.items()}, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
