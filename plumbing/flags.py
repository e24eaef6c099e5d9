"""
Flags: argv to args, all of it. The number types that refuse what training cannot use, the flags
every training script shares (run, task), and the defaults that depend on the task, filled in
here at parse time and nowhere else:

    --out                  out/ for the arithmetic task in the plain format, else out/<task>/
                           (out/countdown/, out/countdown4_r1/, out/toolcalc_tools/ with --tools,
                           ...): the tasks' files never mix
    --init, --rm, ...      a path flag whose default lies under out/ moves with --out's folder
                           (out/sft.pt -> out/countdown/sft.pt)
    --max_new_tokens       the task's completion budget, 34 more in the R1 format (None: unset)
    sft.py --steps         1500, or 4000 for --task countdown (None: unset)
    sft.py --n_layer       2 for --task arithmetic (4 gives the same held-out figures at twice the
                           time), else 4 (None: unset)
    sft.py --pos           rope for --task toolcalc (its second attempt must copy from the first),
                           else learned (None: unset)
    sft.py --block_size    112 for --task toolcalc where it is left at 64 (two attempts must fit);
                           176 with --tools, any task (the tools' system turn, JSON calls)
    sft.py --tokenizer     bytes-chat for a new model with --chat (the built-in chat template)
    --max_new_tokens       (--task toolcalc --chat --tools: 100, a call turn and its reply)

and the checks between flags that parsing can make (--data with gsm8k and only with it, the tool
task and --tools with the scripts that run their environment, --tools with --chat). A flag's bad
value is one line naming the flag, the value and what is allowed (exit 2), before anything loads.
"""
import argparse
import math
import os
import shlex

import task
from hf import tools
from plumbing import live
from tasks import arithmetic, countdown, gsm8k, guess, toolcalc

SFT_PATH = os.path.join("out", "sft.pt")   # default --init of the scripts that start from SFT
RM_PATH = os.path.join("out", "rm.pt")     # default --rm of ppo.py and its kin


# -----------------------------------------------------------------------------
# Number types

FLOAT_MAX = 1e9   # a float flag's upper bound unless it names one: float32 losses stay finite


class _Number:
    """An argparse `type`: parses the flag's text, refuses non-finite values and values out of
    range. Bounds are keyword arguments: gt, ge (lower), lt, le (upper; a float's at most
    FLOAT_MAX)."""
    kind, noun = float, "a number"

    def __init__(self, gt=None, ge=None, lt=None, le=None):
        if self.kind is float and lt is None and le is None:
            le = FLOAT_MAX
        self.bounds = [(op, v) for op, v in (("gt", gt), ("ge", ge), ("lt", lt), ("le", le))
                       if v is not None]
        self.__name__ = self.kind.__name__  # argparse names the type in some messages

    def allowed(self):
        symbols = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
        show = lambda v: str(v) if isinstance(v, int) else f"{v:g}"
        return " and ".join(f"{symbols[op]} {show(v)}" for op, v in self.bounds) or \
            "any finite value"

    def __call__(self, text):
        try:
            value = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {self.noun} (allowed: "
                                             f"{self.allowed()})") from None
        ok = {"gt": lambda v, b: v > b, "ge": lambda v, b: v >= b, "lt": lambda v, b: v < b,
              "le": lambda v, b: v <= b}
        if not math.isfinite(value) or not all(ok[op](value, b) for op, b in self.bounds):
            raise argparse.ArgumentTypeError(f"{text} is not allowed (allowed: {self.noun} "
                                             f"{self.allowed()})")
        return value


class Float(_Number):
    kind, noun = float, "a number"


class Int(_Number):
    kind, noun = int, "an integer"


# The --temperature flags: below 0.05 sampling is argmax, above 20 noise (the kernels accept
# 1e-3 to 1e3, what float32 represents: kernels.MIN_TEMPERATURE, kernels.MAX_TEMPERATURE)
TEMPERATURE = Float(ge=0.05, le=20.0)


# -----------------------------------------------------------------------------
# The parser and the shared flags

class _Parser(argparse.ArgumentParser):
    """@FILE reads flags from a file (`python grpo.py @recipe.txt --lr 1e-6`: later flags win),
    split as a shell splits them, # starting a comment."""

    def __init__(self, **kwargs):
        super().__init__(fromfile_prefix_chars="@", **kwargs)

    def convert_arg_line_to_args(self, arg_line):
        return shlex.split(arg_line, comments=True)

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        if live.check(getattr(parsed, "report_to", "none")):
            self.error(live.check(parsed.report_to))
        check_eval_flags(self, parsed)
        fill_task_defaults(self, parsed)
        return parsed


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each default, except None: such a flag's help says what happens then."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def parser(doc):
    """An ArgumentParser described by the script docstring's first paragraph; its parse_args
    checks the task flags and fills in the task's defaults (module docstring)."""
    return _Parser(description=doc.strip().split("\n\n")[0], formatter_class=_Help)


def add_run_flags(parser, script, log_every, eval_every):
    """The flags every training script has, in a "run" group (returned: scripts add --init)."""
    group = parser.add_argument_group("run")
    add = group.add_argument
    add("--log_every", type=Int(ge=1), default=log_every,
        help="print and log metrics every this many steps")
    add("--eval_every", type=Int(ge=1), default=eval_every,
        help="evaluate on the held-out set and checkpoint every this many steps (and at the last)")
    add("--eval_n", type=Int(ge=1), default=None,
        help="held-out prompts to evaluate on (default: all)")
    add("--eval_temperature", type=Float(ge=0, le=20.0), default=0.0,
        help="held-out decoding: 0 is greedy; above it --eval_k samples a problem, avg@k and "
             "pass@k (evaluation.py)")
    add("--eval_top_p", type=Float(gt=0, le=1), default=1.0,
        help="held-out sampling's nucleus (0.95 in SimpleRL-Zoo's and DeepSeek-R1's reports)")
    add("--eval_k", type=Int(ge=1), default=1, help="held-out samples a problem (sampled)")
    add("--pass_at_1_every", type=Int(ge=1), default=None,
        help="the sampled pass@1 (4 samples a problem at T 1: 4x the greedy pass) at evaluations "
             "every this many steps; default: the first and the last step's alone")
    add("--report_to", default="none", metavar="TRACKER",
        help="mirror every logged row live: tensorboard (into <out>/<script>/, the package "
             "installed apart), or none")
    add("--out", default="out", help=f"folder for {script}.pt and {script}/metrics.jsonl")
    add("--seed", type=Int(ge=0, lt=2**32), default=0, help="seeds python, numpy and torch")
    add("--resume", action="store_true",
        help=f"continue from <out>/{script}.pt up to the step limit")
    add("--device", default=None, help="cuda, mps or cpu (default: the first available)")
    add("--grad_accum", type=Int(ge=1), default=1,
        help="split each step's batch into this many micro-batches (same result, less memory)")
    add("--compile", action="store_true",
        help="sample through a torch.compile'd decode step (sampler.py's \"compile\" mode; the "
             "default on CUDA is already a CUDA graph of the step): the same tokens, faster")
    add("--grad_checkpoint", action="store_true",
        help="recompute each transformer block's activations in backward (less memory, ~30%% "
             "more compute; for real checkpoints)")
    add("--offload_optimizer", action="store_true",
        help="CUDA: keep AdamW's two moments (twice the trainable weights' memory, 3.7 GiB at "
             "Qwen2.5-0.5B) in host memory, on the device only for the optimizer's step, a chunk "
             "of parameters at a time (parking.ParkedMoments): the same numbers, two copies over "
             "PCIe a step; nothing moves on another device")
    add("--batch_invariant", action="store_true",
        help="every product in fixed tiles (kernels/invariant.py): the sampler's log-probs equal "
             "the trainer's bit for bit (sampler_logp_diff 0.0); grpo, rloo, reinforce and agent "
             "take them as pi_old, skipping the policy's recompute; CPU only so far")
    add("--fsdp", action="store_true",
        help="shard the weights, gradients and AdamW moments of what trains over the torchrun "
             "processes (FSDP2; plumbing/distributed.py): each holds 1/world of them, one block "
             "whole at a time, and a whole copy for sampling; in one process a single shard")
    if script not in ("rm", "{orm,prm}"):                     # the scripts that train a policy
        add("--lora_rank", type=Int(ge=0), default=0,
            help="LoRA (lora.py): train rank-r adapters on the projections, every weight frozen; "
                 "the reference is the same weights with the adapters off; 0: full fine-tuning")
        add("--lora_alpha", type=Float(gt=0), default=32.0,
            help="LoRA's alpha: the adapters' output is scaled by alpha / rank")
        add("--lora_targets", type=lambda s: [t.strip() for t in s.split(",") if t.strip()],
            default=None,
            help="comma-separated projections to adapt, of those the model has: "
                 "q,k,v,o,gate,up,down (Llama, Qwen), qkv,o,up,down (GPT-2, this project's GPT), "
                 "q,k,v,o,up,down (sft.py --pos rope); default: all")
    add_task_flags(parser)
    return group


def add_task_flags(parser):
    """--task, --format, --data, --countdown_numbers, --countdown_rule and --chat, in a "task"
    group (task.use reads them)."""
    g = parser.add_argument_group("task")
    g.add_argument("--task", default="arithmetic", choices=task.TASKS,
                   help="the problems, verifier and demonstrations")
    g.add_argument("--format", default="plain", choices=task.FORMATS,
                   help="plain: the task's own; r1: DeepSeek-R1-Zero's <think>/<answer> template")
    g.add_argument("--data", nargs="+", default=None, metavar="JSONL",
                   help="--task gsm8k: a GSM8K-format file, and optionally a held-out file (else "
                        "its last tenth)")
    g.add_argument("--countdown_numbers", type=Int(ge=3, le=4), default=3,
                   help="--task countdown: numbers given")
    g.add_argument("--countdown_rule", choices=["exactly", "at_most"], default="exactly",
                   help="--task countdown: each number used exactly once (the field's rule), or "
                        "at most once")
    g.add_argument("--chat", action="store_true",
                   help="render each prompt through the checkpoint's own chat template as the "
                        "user's message (a Hugging Face folder's, or a checkpoint trained from "
                        "one; hf/chat.py); the end of the assistant's turn (<|im_end|>, "
                        "<|eot_id|>) ends a completion and a demonstration")
    g.add_argument("--tools", default=None, metavar="NAMES",
                   help="with --chat: tools the model calls in its chat template's own protocol "
                        "(agent.py episodes, sft.py demonstrations): comma-separated, built in "
                        "(calculator) or module:function (any function with type hints and a "
                        "docstring; hf/tools.py)")
    g.add_argument("--tools_env", default="", metavar="NAMES",
                   help="with --tools: the run's environment variables the tools' worker keeps "
                        "(comma-separated); it has none but PATH, HOME, locale and Python's "
                        "(docs/errors.md)")
    return g


# -----------------------------------------------------------------------------
# The task's defaults and the checks between flags

def check_eval_flags(parser, args):
    """--eval_k and --eval_top_p sample: they need --eval_temperature above 0; the nucleus is
    drawn for single completions, not for episodes (the game, tools)."""
    if getattr(args, "eval_temperature", None) != 0:
        if getattr(args, "eval_top_p", 1.0) < 1 and (getattr(args, "tools", None) is not None
                                                     or getattr(args, "task", None) in
                                                     ("guess", "toolcalc")):
            parser.error(f"--eval_top_p {args.eval_top_p}: episodes (--task {args.task}"
                         f"{' --tools' if getattr(args, 'tools', None) else ''}) sample the "
                         f"full softmax; allowed: --eval_top_p 1")
        return
    for flag, default in (("eval_k", 1), ("eval_top_p", 1.0)):
        if getattr(args, flag, default) != default:
            parser.error(f"--{flag} {getattr(args, flag)}: greedy decoding (--eval_temperature "
                         f"0) gives one answer; allowed with --eval_temperature above 0")


def fill_task_defaults(parser, args):
    """The checks and defaults of the module docstring, on parsed `args` (parse_args calls it)."""
    if getattr(args, "task", None) is None:
        return
    if args.task == "gsm8k" and not args.data:
        parser.error("--task gsm8k needs --data FILE.jsonl [HELD_OUT.jsonl] (GSM8K's format; "
                     "nothing is downloaded)")
    if args.task != "gsm8k" and args.data:
        parser.error(f"--data is for --task gsm8k; --task {args.task} is generated in code")
    if args.data and len(args.data) > 2:
        parser.error(f"--data takes one or two files (training, held-out); got {len(args.data)}")
    if getattr(args, "tools", None) is not None:
        _tools(parser, args)
    elif getattr(args, "tools_env", ""):
        parser.error(f"--tools_env {args.tools_env}: for the worker of --tools; add --tools")
    if args.task == "toolcalc":
        _tool_defaults(parser, args)
    if args.task == "guess":
        _game_defaults(parser, args)
    for action in parser._actions:                   # path defaults under out/: the task's folder
        default = action.default
        if isinstance(default, str) and (default == "out" or default.startswith("out" + os.sep)) \
                and getattr(args, action.dest, None) == default:
            setattr(args, action.dest, os.path.normpath(os.path.join(
                folder(args), os.path.relpath(default, "out"))))
    if getattr(args, "max_new_tokens", 0) is None and args.task == "toolcalc" and args.tools:
        args.max_new_tokens = toolcalc.CHAT_MAX_NEW_TOKENS
    if getattr(args, "max_new_tokens", 0) is None:   # the task's completion budget
        budget = {"arithmetic": arithmetic.MAX_NEW_TOKENS, "gsm8k": gsm8k.MAX_NEW_TOKENS,
                  "toolcalc": toolcalc.MAX_NEW_TOKENS, "guess": guess.MAX_NEW_TOKENS,
                  "countdown": countdown.MAX_NEW_TOKENS[args.countdown_numbers]}[args.task]
        args.max_new_tokens = budget + (task.R1_EXTRA_TOKENS if args.format == "r1" else 0)
    if hasattr(args, "mistake_rate"):                # sft.py
        if args.steps is None:   # countdown at 1500 steps: held-out 0.35, its arithmetic half known
            args.steps = 4000 if args.task == "countdown" else 1500
        if args.n_layer is None:
            args.n_layer = 2 if args.task == "arithmetic" else 4
        args.pos = args.pos or "learned"
        if args.chat and args.init is None and args.tokenizer == "bytes":
            args.tokenizer = "bytes-chat"


def _tools(parser, args):
    """--tools: with --chat, in the scripts that run episodes or demonstrations; names that
    resolve (tools.resolve)."""
    if not args.chat:
        parser.error(f"--tools {args.tools}: tools are called in the chat template's protocol; "
                     f"add --chat")
    if not (hasattr(args, "max_calls") or hasattr(args, "mistake_rate")):
        parser.error(f"--tools {args.tools}: agent.py trains with tools (episodes), sft.py on "
                     f"their demonstrations; this script has neither")
    if args.format != "plain":
        parser.error(f"--tools is defined in the plain format only; got --format {args.format}")
    try:
        tools.keep_environment(args.tools_env)
        tools.resolve(args.tools)
    except ValueError as e:
        parser.error(str(e))
    if getattr(args, "block_size", None) == 64:      # sft.py: the tools' system turn, JSON calls
        args.block_size = toolcalc.CHAT_BLOCK_SIZE


def _tool_defaults(parser, args):
    """--task toolcalc: only sft.py (its demonstrations) and agent.py (its episodes) run its
    environment; the plain format only; sft.py's --block_size and --pos defaults."""
    if not (hasattr(args, "max_calls") or hasattr(args, "mistake_rate")):
        parser.error("--task toolcalc needs its environment (the calculator answering calls): "
                     "train on it with sft.py (demonstrations) and agent.py (episodes)")
    if args.format != "plain":
        parser.error(f"--task toolcalc is defined in the plain format only; got --format "
                     f"{args.format}")
    if args.chat and not args.tools:
        parser.error("--task toolcalc --chat: the calls go in the chat template's protocol; add "
                     "--tools calculator")
    if hasattr(args, "pos") and args.pos is None:
        args.pos = toolcalc.POSITIONS
    least = toolcalc.CHAT_BLOCK_SIZE if args.tools else toolcalc.BLOCK_SIZE
    if getattr(args, "block_size", None) == 64:
        args.block_size = least
    elif getattr(args, "block_size", least) < least:
        parser.error(f"--block_size {args.block_size} is too short for --task toolcalc's "
                     f"demonstrations; allowed: --block_size >= {least}")


def _game_defaults(parser, args):
    """--task guess: only sft.py (its demonstrations) and multiturn.py (its episodes) run the
    game's answers between turns; the plain format only; sft.py's --block_size with --chat."""
    if not (hasattr(args, "credit") or hasattr(args, "mistake_rate")):
        parser.error("--task guess needs its environment (an answer after every guess): train "
                     "on it with sft.py (demonstrations) and multiturn.py (episodes)")
    if args.format != "plain":
        parser.error(f"--task guess is defined in the plain format only; got --format "
                     f"{args.format}")
    if args.chat and getattr(args, "block_size", None) == 64:
        args.block_size = guess.CHAT_BLOCK_SIZE          # sft.py: four turns in a template


def require_arithmetic(parser, args, what):
    """A parse error unless args choose the arithmetic task in its plain format: for what only
    it defines."""
    if (args.task, args.format) != ("arithmetic", "plain"):
        parser.error(f"{what} is defined for the arithmetic task in its plain format only; got "
                     f"--task {args.task} --format {args.format}")


def folder(args):
    """Where a script's default outputs go: out/ for the arithmetic task in the plain format,
    else out/<task>/ with the setting (out/countdown4_r1/, out/toolcalc_tools/)."""
    name, fmt = getattr(args, "task", "arithmetic"), getattr(args, "format", "plain")
    tools = "_tools" if getattr(args, "tools", None) else ""
    if name == "arithmetic" and fmt == "plain" and not tools:
        return "out"
    numbers = str(args.countdown_numbers) if name == "countdown" and \
        args.countdown_numbers != 3 else ""
    rule = "_atmost" if name == "countdown" and \
        getattr(args, "countdown_rule", "exactly") == "at_most" else ""
    return os.path.join("out", name + numbers + rule + ("_r1" if fmt == "r1" else "") + tools)


def default_path(path, args):
    """A default path under out/ (out/sft.pt) for the task in `args` (out/countdown/sft.pt)."""
    return os.path.normpath(os.path.join(folder(args), os.path.relpath(path, "out")))


def task_flags(args):
    """The task flags of `args`, to hand to a script that builds a missing prerequisite."""
    if getattr(args, "task", None) is None:
        return []
    out = ["--task", args.task, "--format", args.format,
           "--countdown_numbers", str(args.countdown_numbers),
           "--countdown_rule", getattr(args, "countdown_rule", "exactly")]
    out += ["--chat"] if getattr(args, "chat", False) else []
    out += ["--tools", args.tools] if getattr(args, "tools", None) else []
    return out + (["--data", *args.data] if args.data else [])
