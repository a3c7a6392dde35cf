from setuptools import find_packages, setup

EVAL = ["lm-eval[hf]==0.4.13", "pyarrow==22.0.0", "pandas>=2,<3"]

setup(
    name="fairseq_megatron",
    version="0.1.0",
    description="Megatron-style tensor-model-parallel language models for fairseq (--user-dir plugin)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.8",
    packages=find_packages(include=["fairseq_megatron", "fairseq_megatron.*"]),
    install_requires=[
        'fairseq-fixed==0.12.3.1; python_version >= "3.11"',
        'fairseq==0.12.2; python_version < "3.11"',
        "torch>=2.0",
        "fairscale==0.4.13",
        "sacremoses",
        "numpy<2",  # fairseq 0.12 uses numpy.compat (gone in numpy 2), e.g. in TokenBlockDataset
        "regex",
        "tqdm",
        "tiktoken",  # fast GPT-2 BPE in examples/megatron_11b
    ],
    extras_require={
        # fairseq-megatron-reshard --to-hf: transformers' XGLMForCausalLM, safetensors weights, a fast tokenizer
        "hf": ["transformers>=4.40", "safetensors"],
        # --fp8: torchao's float8 training (and a GPU of compute capability 8.9 or newer)
        "fp8": ["torchao==0.18.0"],
        # fairseq-megatron-lm-eval: lm-evaluation-harness, pinned with what it pulls that needs numpy >= 2
        # elsewhere (pandas 3, pyarrow 26: pyarrow says so only at import, and datasets then loads no task)
        "eval": EVAL,
        # torchao: the --fp8 tests emulate float8 on the CPU
        "test": ["pytest", "pytest-xdist", "tokenizers", "matplotlib", "transformers>=4.40", "safetensors",
                 "torchao==0.18.0", *EVAL],
    },
    entry_points={
        "console_scripts": [
            "fairseq-megatron-reshard = fairseq_megatron.cli.reshard_checkpoint:main",
            "fairseq-megatron-plan = fairseq_megatron.cli.plan_parallelism:main",
            "fairseq-megatron-hydra-train = fairseq_megatron.cli.hydra_train:main",
            "fairseq-megatron-lm-eval = fairseq_megatron.cli.lm_eval_harness:main",
        ],
        # for an lm-evaluation-harness that finds model backends in installed packages (0.4.13 does not)
        "lm_eval.models": ["fairseq_megatron = fairseq_megatron.lm_eval_harness:FairseqMegatronLM"]
    },
)
