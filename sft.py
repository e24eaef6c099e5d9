"""
Supervised fine-tuning (SFT): the warm start every other script begins from.

Teacher forcing on the task's demonstrations, from random initialisation. The loss is the
negative log-likelihood of the completion tokens only (the prompt is context, not a target):

    L(theta) = - (1 / sum_t m_t) * sum_t m_t * log pi_theta(y_t | x, y_<t)

where m_t is 1 on completion tokens (the final EOS included) and 0 on prompt and padding.
SFT imitates the demonstrator, mistakes included: it puts the policy where rewards happen, so that
RL has successes to reinforce. The demonstrations ignore operator precedence `--mistake_rate` of the
time, so the policy this script writes is deliberately imperfect, and the RL scripts have room to
show what they do.

Run:
    python sft.py                      # about a minute on 2 CPU cores; writes out/sft.pt
    python sft.py --resume             # continue from out/sft.pt up to --steps
Metrics: one JSON object per log step in out/sft/metrics.jsonl.
"""
import torch

import task
from hf.tokenizer import CheckpointError, Tokenizer
from lora import trainable
from model import GPT, GPTConfig, masked_mean, token_logprobs
from plumbing import Run, lr_schedule
from plumbing.flags import Float, Int, add_run_flags, parser


# -----------------------------------------------------------------------------
# Hyperparameters

def parse_args(argv=None):
    p = parser(__doc__)
    g = p.add_argument_group("data")
    g.add_argument("--mistake_rate", type=Float(ge=0, le=1), default=0.6,
                   help="share of demonstrations evaluated left to right")
    g.add_argument("--precedence_share", type=Float(ge=0, le=1), default=None,
                   help="share of problems where precedence matters (default: the task's; "
                        "arithmetic: 0.5)")
    g.add_argument("--hint_share", type=Float(ge=0, le=1), default=0.0,
                   help="share of demonstrations whose prompt carries the verified answer "
                        "(task.privileged), each with the right completion: a policy that reads "
                        "it, self_distill.py's start")
    g = p.add_argument_group("model")
    g.add_argument("--n_layer", type=Int(ge=1), default=None,
                   help="transformer blocks (default 2 for --task arithmetic, else 4)")
    g.add_argument("--block_size", type=Int(ge=8), default=64,
                   help="longest sequence (prompt + completion)")
    g.add_argument("--n_head", type=Int(ge=1), default=4, help="attention heads")
    g.add_argument("--n_embd", type=Int(ge=1), default=128,
                   help="model width (a multiple of --n_head)")
    g.add_argument("--pos", default=None, choices=["learned", "rope"],
                   help="positions: learned absolute (GPT-2) or rotary (default: rotary for "
                        "--task toolcalc, else learned)")
    g.add_argument("--tokenizer", default="bytes",
                   help="'bytes' (built in, offline; 'bytes-chat' under --chat, with a chat "
                        "template) or a tiktoken encoding name")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=Int(ge=1), default=None,
                   help="optimisation steps (default 1500; 4000 for --task countdown, slower "
                        "to fit)")
    g.add_argument("--batch_size", type=Int(ge=1), default=64, help="demonstrations per step")
    g.add_argument("--lr", type=Float(gt=0), default=2e-3, help="peak AdamW learning rate")
    g.add_argument("--warmup", type=Int(ge=0), default=50,
                   help="linear warm-up steps, then cosine decay to lr/10")
    g.add_argument("--weight_decay", type=Float(ge=0), default=0.01, help="AdamW weight decay")
    g.add_argument("--grad_clip", type=Float(gt=0), default=1.0,
                   help="clip the gradient's global norm to this")
    g = add_run_flags(p, "sft", log_every=50, eval_every=500)
    g.add_argument("--init", default=None,
                   help="fine-tune this checkpoint or Hugging Face folder (GPT-2, Llama, Qwen2, "
                        "Qwen3) instead of a new model (the model flags are then the "
                        "checkpoint's)")
    args = p.parse_args(argv)
    if args.lora_rank and args.init is None:
        p.error(f"--lora_rank {args.lora_rank} adapts a trained model's weights: it needs "
                f"--init (a new model trains every weight)")
    if args.n_embd % args.n_head:
        p.error(f"--n_embd {args.n_embd} must be a multiple of --n_head {args.n_head}")
    if args.hint_share and (args.task == "toolcalc" or args.tools):
        p.error(f"--hint_share {args.hint_share}: the verified answer goes ahead of a problem's "
                f"text; not with --task toolcalc or --tools (episodes)")
    return args


def main(args):
    # device, seeds, lock, log, resume, torchrun: plumbing/run.py
    run = Run("sft", args, batch_flag="batch_size")
    if args.init is not None:                    # a checkpoint or a Hugging Face folder, fine-tuned
        model, tok = run.load(args.init)
        model = run.adapt(model)                 # --lora_rank: adapters, every weight frozen
        run.check_demonstrations(model, tok)     # its prompts and demonstrations fit
    else:                                        # a new model
        try:
            tok = Tokenizer(args.tokenizer)
            tok = tok.use_chat(run.chat_date) if task.chat() else tok   # bytes-chat's template
        except (ValueError, CheckpointError) as e:
            raise SystemExit(f"error: --tokenizer: {e}") from None
        run.tokenizer_name = tok.name
        longest, budget = task.max_prompt_tokens(tok), task.longest_demonstration(tok)
        if args.hint_share:                      # the privileged prompts are longer
            longest = max(longest, task.max_privileged_tokens(tok))
        # the task's longest prompt and completion budget must fit
        if longest + budget > args.block_size:
            raise SystemExit(f"error: --block_size {args.block_size} is too short for "
                             f"--task {task.name()}: its longest prompt is {longest} tokens and "
                             f"its completions up to {budget}; allowed: --block_size "
                             f">= {longest + budget}")
        model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=args.block_size,
                              n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                              pos=args.pos)).to(run.device)
    model.grad_checkpoint = args.grad_checkpoint
    train_model = run.ddp(model)     # DDP or --fsdp's shards under torchrun, else the model
    optimizer = torch.optim.AdamW(trainable(train_model), lr=args.lr,
                                  weight_decay=args.weight_decay, betas=(0.9, 0.99))
    run.resume(model, optimizer)
    run.print(f"SFT: {model.num_params() / 1e6:.2f}M parameters on {run.device}, {args.steps} "
              f"steps of {args.batch_size}")
    if not args.resume:                             # a fresh run: random init (or --init) is step 0
        run.log_start(run.evaluate(model, tok),
                      "random init" if args.init is None else "the --init model")

    model.train()
    while run.training():
        # 1. a batch of demonstrations (this rank's share), prompt + completion + EOS
        for group in optimizer.param_groups:
            group["lr"] = lr_schedule(run.step, args.lr, args.warmup, args.steps)
        demos = task.sample_demonstrations(run.rng, args.batch_size, args.mistake_rate,
                                           args.precedence_share)
        if args.hint_share:      # some prompts carry the verified answer, their completions right
            demos = [(task.privileged(p), task.demonstration(p)) if run.rng.random() <
                     args.hint_share else (p, c) for p, c in demos]
        demos = run.shard(demos)
        tokens, attn, loss_mask = task.completion_batch([p for p, _ in demos],
                                                        [c for _, c in demos], tok, run.device)

        # 2. teacher forcing: the mean negative log-likelihood of the completion tokens of the whole
        #    batch (every rank's), over the --grad_accum micro-batches
        n_tokens = run.all_sum(loss_mask.sum())
        optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        for rows in run.micro_batches(len(tokens), train_model):
            with run.autocast:                                   # (b, T-1) float32: log pi(y_t | .)
                logp = token_logprobs(train_model, tokens[rows, :-1], attn[rows, :-1],
                                      tokens[rows, 1:])
            # this part's share of the mean NLL
            part = -masked_mean(logp, loss_mask[rows], n_tokens)
            run.check_finite(part, f"lower --lr (now {args.lr})")
            part.backward()
            loss += part.item()
        grad_norm = run.clip_grad_norm(train_model, args.grad_clip)
        optimizer.step()
        run.step += 1
        run.tokens += int(run.all_sum(attn.sum()))

        # 3. log, evaluate, checkpoint
        if run.log_due():
            metrics = {"loss": run.all_sum(loss).item(), "grad_norm": grad_norm.item(),
                       "lr": lr_schedule(run.step - 1, args.lr, args.warmup, args.steps)}
            if run.eval_due():
                metrics.update(run.evaluate(model, tok))
            run.log(metrics, f"loss {metrics['loss']:.4f} | lr {metrics['lr']:.2e}", tokens=True)
        if run.eval_due():
            run.save(model, optimizer)
    run.finish(model, tok, optimizer)


if __name__ == "__main__":
    main(parse_args())
