"""Code that only the notebooks and scripts use: experiments of the paper and beyond it, restated
baselines.

==========================  ================================================================
module                      what it holds
==========================  ================================================================
``synthetic``               the synthetic covariance experiment (Sec. 6.1): MLPs, rank sweeps
``synthetic_gradients``     gradients with a linear layer's structure (runtime study, Sec. 4.2)
``authors``                 the authors' ``svds`` approach to MFF, restated as a baseline
``benchmark``               timing MFF against it on the same gradients (Sec. 4.2)
``spectrum``                the Kronecker spectrum of every linear layer (Fig. singular_values)
``throughput``              FLOPs and measured speed of compressed decoders (App. F)
``glue``                    the encoder study (Sec. 6.2): splits, fine-tuning (cached), compression
``glue_summary``            its tables (Tab. glue_results, glue_extended) and verdicts
``llm_compression``         the decoder study (Sec. 6.3 and appendices): protocol, calibration, the study
``cases``                   a case of it, the keys of its scores and the scores kept on disk
``loss_noise``              per-token and per-window losses; the sensitivity sweep's noise
``pitfall``                 GFWSVD with the output-side Cholesky factor untransposed (a public reimplementation)
``llm_summary``             the decoder study's tables in the paper's layout and its verdicts
``extra_compression``       learned truncation and LoRA recovery on a weighted SVD (Sec. 6.4)
``extra_summary``           its table (Tab. extra-compression-results) and verdicts
``rank_allocation``         the rank-allocation study (Sec. 6.3 protocol): methods x allocations x ratios
``allocation_cost``         five rank allocations: quality against the evaluations they spend
``calibration_study``       calibration at scale: quality and cost against k and granularity
``scale``                   SmolLM2-135M, Gemma 3 270M, Qwen2.5-0.5B: GFWSVD's gap against model size
``teaching``                the weighted-SVD family as dense transformation pairs (Fig. connection2fwsvd)
==========================  ================================================================

Import the modules themselves (``from fisherkron.experiments import synthetic``); nothing
is re-exported here, so importing this package costs nothing. The repository's tooling (running,
recording and verifying notebooks, the book) is :mod:`fisherkron.repro`.
"""
