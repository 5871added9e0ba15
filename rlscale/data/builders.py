"""TFDS builders that materialize the synthetic tasks as array_record files.

Read back with `tfds` data sources (random access, no TensorFlow):

    sources = builders.materialize("arithmetic", difficulty=2, n_train=5000, n_test=500,
                                   data_dir=WORKDIR + "/data")
    sources["train"][17]  # {"prompt": b"Q: ...", "answer": b"...", "demo": b"...", ...}
"""

import dataclasses

import numpy as np
import tensorflow_datasets as tfds

from rlscale import console
from rlscale.data import tasks


@dataclasses.dataclass
class TaskConfig(tfds.core.BuilderConfig):
    task: str = "arithmetic"
    difficulty: int = 2
    seed: int = 0
    n_train: int = 1000
    n_test: int = 200


class SyntheticTasks(tfds.core.GeneratorBasedBuilder):
    """One config per (task, difficulty, seed, sizes); splits `train` and `test`."""

    # Bump when generation changes, so cached datasets of the old version are not reused.
    VERSION = tfds.core.Version("1.1.0")
    RELEASE_NOTES = {
        "1.0.0": "Arithmetic demonstrations fold the products, then the sums in one step.",
        "1.1.0": "Arithmetic demonstrations take one operation per step.",
    }
    BUILDER_CONFIGS = [TaskConfig(name="arithmetic_d2")]

    def _info(self):
        return self.dataset_info_from_configs(
            description="Synthetic verifiable reasoning tasks (rlscale.data.tasks).",
            disable_shuffling=True,  # Keep the generator's order: record i is problem i.
            features=tfds.features.FeaturesDict(
                {
                    "prompt": tfds.features.Text(),
                    "answer": tfds.features.Text(),
                    "demo": tfds.features.Text(),
                    "index": np.int64,
                }
            ),
        )

    def _split_generators(self, dl_manager):
        del dl_manager
        c = self.builder_config
        return {
            "train": self._generate_examples("train", c.n_train),
            "test": self._generate_examples("test", c.n_test),
        }

    def _generate_examples(self, split, n):
        c = self.builder_config
        task = tasks.get(c.task, c.difficulty, c.seed)
        for i, p in enumerate(task.problems(split, n)):
            yield i, {"prompt": p.prompt, "answer": p.answer, "demo": p.demo, "index": i}


def config_name(task: str, difficulty: int, seed: int, n_train: int, n_test: int) -> str:
    return f"{task}_d{difficulty}_s{seed}_{n_train}_{n_test}"


def materialize(
    task: str, difficulty: int, n_train: int, n_test: int, data_dir: str, seed: int = 0
) -> dict:
    """Builds the dataset once (reused afterwards) and returns {split: data source}."""
    tasks.get(task, difficulty, seed)  # Validates the name and difficulty first.
    config = TaskConfig(
        name=config_name(task, difficulty, seed, n_train, n_test),
        task=task,
        difficulty=difficulty,
        seed=seed,
        n_train=n_train,
        n_test=n_test,
    )
    return prepare(SyntheticTasks(data_dir=data_dir, config=config, file_format="array_record"))


def prepare(builder: tfds.core.DatasetBuilder) -> dict:
    """Builds `builder`'s dataset unless it is on disk already; returns {split: data source}.
    (`data_path`, not `is_prepared`, which warns about a folder it does not find.)"""
    if not builder.data_path.exists():
        with console.library_prints():  # TFDS prints "Downloading and preparing dataset ...".
            builder.download_and_prepare()
    return builder.as_data_source()


def text_fields(example: dict) -> dict:
    """A data-source record with its text fields as `str`."""
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in example.items()}


def decode(example: dict) -> tasks.Problem:
    """A data-source record as a Problem."""
    text = text_fields(example)
    return tasks.Problem(prompt=text["prompt"], answer=text["answer"], demo=text["demo"])
