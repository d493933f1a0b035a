"""Code that only the notebooks and scripts use: experiments of the paper, restated baselines, figures.

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
``rank_allocation``         the rank-allocation study (Sec. 6.3 protocol): methods x allocations x ratios
``calibration_study``       calibration at scale: quality and cost against k and granularity
``llm_compression``         the decoder study (Sec. 6.3 and appendices): protocol, cached cases, sweep noise
``llm_summary``             its tables in the paper's layout and its verdicts
``extra_compression``       learned truncation and LoRA recovery on a weighted SVD (Sec. 6.4)
``teaching``                the weighted-SVD family as dense transformation pairs (Fig. connection2fwsvd)
``figures``                 figures and tables written atomically with provenance records
``readme``                  README.md's generated numbers, rendered from the committed outputs
``book``                    the committed executed notebooks and the static site of them (``make book``)
``tolerance``               how far a rerun's table value may fall from the committed one
``verify``                  ``make verify``: rerun notebooks into build/verify, compare tables
``verify_tolerances``       tolerances of tables whose notebook declares none
==========================  ================================================================

Import the modules themselves (``from fisherkron.experiments import synthetic``); nothing
is re-exported here, so importing this package costs nothing.
"""
