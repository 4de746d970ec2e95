"""Outside training scripts ported to epochal, each tested against its unmodified original.

- :mod:`epochal_ports.dcgan`: pytorch/examples' DCGAN: two modules, two optimizers, manual
  optimization in the script's order.
- :mod:`epochal_ports.vae`: pytorch/examples' VAE: a loss of the module's intermediate outputs.
- :mod:`epochal_ports.causal_lm`: a Hugging Face causal LM that computes its own loss.

The originals of pytorch/examples are in ``originals/`` (BSD-3-Clause, their LICENSE beside
them), unmodified; ``tests/test_ports.py`` runs each original and its port and compares them.
"""
