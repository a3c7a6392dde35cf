"""README.md, docs/ and the examples: every command shown parses as written,
every relative link leads to a file.

Most of them need GPUs, nodes or the published checkpoint, so the test does
not run them: it hands each one's arguments to the parser of the program
that would read them (fairseq's own parser with this plugin loaded through
``--user-dir``, torchrun's, our scripts'), so a renamed or removed flag fails
here instead of in a user's shell.
"""

import argparse
import importlib.util
import os
import re
import shlex
import sys

import pytest
from fairseq import options

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLUGIN_DIR = os.path.join(ROOT, "fairseq_megatron")
DOCUMENTS = ["README.md", "examples/megatron_11b/README.md"] + sorted(
    os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md")
)
# Shell variables the documents use, with a value of the right kind.
SHELL_VALUES = {"$USER_DIR": PLUGIN_DIR, "$NODE_RANK": "0", "$MASTER": "127.0.0.1"}
FAIRSEQ_PARSERS = {
    "fairseq-train": options.get_training_parser,
    "fairseq-eval-lm": options.get_eval_lm_parser,
    "fairseq-validate": options.get_validation_parser,
    "fairseq-generate": options.get_generation_parser,
    "fairseq-interactive": options.get_interactive_generation_parser,
}
# Programs whose arguments are not ours to check.
NOT_OURS = {"pip", "cp"}


def shell_commands(path):
    """The commands of a Markdown file's ```bash blocks, continuation lines
    joined, comments dropped, shell variables given values."""
    text = open(os.path.join(ROOT, path)).read()
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S):
        for command in block.replace("\\\n", " ").splitlines():
            command = command.split(" #")[0].strip()
            if not command or command.startswith("#"):
                continue
            command = re.sub(r"\$\(which ([\w-]+)\)", r"\1", command)
            for name, value in SHELL_VALUES.items():
                command = command.replace(name, value)
            commands.append(command)
    return commands


ALL_COMMANDS = [(path, command) for path in DOCUMENTS for command in shell_commands(path)]


def load_script(relative_path):
    """The script's module, its folder first on the path as when Python runs it (for the modules beside it)."""
    path = os.path.join(ROOT, relative_path)
    spec = importlib.util.spec_from_file_location(os.path.basename(relative_path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(path))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(os.path.dirname(path))
    return module


def parse_strictly(parser: argparse.ArgumentParser, argv):
    """argparse exits on an unknown flag; turn that into a test failure
    that names the flag (argparse has printed it to stderr)."""
    try:
        return parser.parse_args(argv)
    except SystemExit as exit_:
        pytest.fail(f"{parser.prog} refused {argv} (exit {exit_.code})")


def check_fairseq_tool(tool, argv):
    if "--user-dir" in argv:
        assert argv[argv.index("--user-dir") + 1] == PLUGIN_DIR
    try:
        args = options.parse_args_and_arch(FAIRSEQ_PARSERS[tool](), argv)
    except SystemExit as exit_:
        pytest.fail(f"{tool} refused {argv} (exit {exit_.code})")
    if "--arch" in argv:
        assert args.arch == argv[argv.index("--arch") + 1]


def check_hydra_overrides(argv):
    """``key.field=value`` overrides name fields of fairseq's config."""
    from fairseq.dataclass.configs import FairseqConfig

    flags = {"--config-dir", "--config-name"}
    overrides = [a for i, a in enumerate(argv) if a not in flags and (i == 0 or argv[i - 1] not in flags)]
    assert overrides, argv
    for override in overrides:
        group, field = override.split("=")[0].split(".")
        group_config = FairseqConfig.__dataclass_fields__[group].default
        assert field in group_config.__dataclass_fields__, override


def check_gpu_check_flags(argv):
    script = open(os.path.join(ROOT, "scripts/gpu_check.sh")).read()
    for flag in (a for a in argv if a.startswith("--")):
        handled = rf"^\s*{re.escape(flag)}\)|\[ \"\$\{{1:-\}}\" = \"{re.escape(flag)}\" \]"
        assert re.search(handled, script, flags=re.M), f"gpu_check.sh has no {flag}"


def check_pytest(argv):
    """The test files a pytest command names exist, and so does a test its ``-k`` names."""
    files = [a for a in argv if a.startswith("tests/")]
    assert files and all(os.path.exists(os.path.join(ROOT, f.split("::")[0])) for f in files), argv
    if "-k" in argv:
        text = "".join(open(os.path.join(ROOT, f.split("::")[0])).read() for f in files)
        assert re.search(rf"def test_\w*{re.escape(argv[argv.index('-k') + 1])}", text), argv


def check_lm_eval(argv):
    """lm-eval's ``run`` parser takes the flags, and the backend the model arguments."""
    from lm_eval._cli.harness import HarnessCLI

    from fairseq_megatron.lm_eval_harness import ARGUMENTS

    args = parse_strictly(HarnessCLI()._subparsers.choices["run"], argv)
    given = set(args.model_args or {})  # lm-eval's parser makes a dict of a=1,b=2
    assert given and given <= set(ARGUMENTS), given - set(ARGUMENTS)


def check(words):
    program, argv = words[0], words[1:]
    if re.match(r"^\w+=\$\(", program):  # VAR=$(python -m module)
        module = re.search(r"-m ([\w.]+)\)", " ".join(words)).group(1)
        assert importlib.util.find_spec(module) is not None, module
    elif re.match(r"^[A-Z_]+=[^$]*$", program):  # an environment variable set for the command
        check(argv)
    elif program.endswith("python") and argv[:2] == ["-m", "pytest"]:
        check_pytest(argv[2:])
    elif program == "torchrun":
        from torch.distributed.run import get_args_parser

        launched = parse_strictly(get_args_parser(), argv)
        check([launched.training_script] + launched.training_script_args)
    elif program == "srun":
        tool = next(i for i, word in enumerate(argv) if word in FAIRSEQ_PARSERS)
        check(argv[tool:])
    elif program in FAIRSEQ_PARSERS:
        check_fairseq_tool(program, argv)
    elif program == "fairseq-preprocess":
        parse_strictly(options.get_preprocessing_parser(), argv)
    elif program == "fairseq-megatron-reshard":
        from fairseq_megatron.cli.reshard_checkpoint import build_parser

        parse_strictly(build_parser(), argv)
    elif program == "fairseq-megatron-plan":
        from fairseq_megatron.cli.plan_parallelism import build_parser

        parse_strictly(build_parser(), argv)
    elif program == "fairseq-megatron-lm-eval":
        check_lm_eval(argv)
    elif program == "fairseq-megatron-hydra-train":
        check_hydra_overrides(argv)
    elif program == "python" and argv[0].endswith(".py"):
        parse_strictly(load_script(argv[0]).build_parser(), argv[1:])
    elif program == "bash" and argv[0] == "scripts/gpu_check.sh":
        check_gpu_check_flags(argv[1:])
    elif program == "make":
        makefile = open(os.path.join(ROOT, "Makefile")).read()
        assert re.search(rf"^{re.escape(argv[0])}:", makefile, flags=re.M), f"no make target {argv[0]}"
    else:
        assert program in NOT_OURS, f"no check for {program!r}: add one to this test"


def test_the_documents_show_commands():
    documents = {path for path, _ in ALL_COMMANDS}
    assert "README.md" in documents and "docs/training.md" in documents
    assert sum(path == "README.md" for path, _ in ALL_COMMANDS) >= 7


@pytest.mark.parametrize("path,command", ALL_COMMANDS, ids=[f"{p}:{c[:40]}" for p, c in ALL_COMMANDS])
def test_command_parses(path, command, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["documented-command"])
    check(shlex.split(command))


def test_a_renamed_flag_fails():
    """The check itself refuses what the tools would refuse."""
    with pytest.raises(pytest.fail.Exception):
        check(shlex.split(f"fairseq-train data-bin --user-dir {PLUGIN_DIR} --arch transformer_lm_megatron_11b "
                          "--task language_modeling --model-paralel-size 2"))
    with pytest.raises(pytest.fail.Exception):
        check(shlex.split("fairseq-megatron-reshard --input a.pt --output b.pt --to-fairseq-lm"))
    with pytest.raises(AssertionError):
        check(shlex.split("fairseq-megatron-hydra-train --config-dir c --config-name lm checkpoint.save_dri=x"))
    with pytest.raises(AssertionError):
        check(shlex.split("UPDATES=2 .venv/bin/python -m pytest tests/e2e/test_readers.py -k besides_a_training"))


@pytest.mark.parametrize("path", DOCUMENTS)
def test_relative_links_lead_to_files(path):
    text = open(os.path.join(ROOT, path)).read()
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t]
    missing = [t for t in targets if t and not os.path.exists(os.path.join(ROOT, os.path.dirname(path), t))]
    assert not missing, f"{path} links to missing files: {missing}"
