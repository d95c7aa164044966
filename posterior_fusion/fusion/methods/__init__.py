"""The fusion methods, one module each: its function, its settings record and its registry
entry ``METHOD`` (what it needs, what it costs, its one-line summary). The machinery they share
(inputs, optimiser, stacking, distillation, the registry) lives one level up in ``fusion/``."""
