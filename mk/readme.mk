# README.md's numbers (issue 24, "numbers that cannot drift"). Every number of the README's results
# sections sits in a block between <!-- generated:NAME --> and <!-- /generated:NAME --> markers,
# rendered by fisherkron/experiments/readme/ from the committed tables and provenance records in
# figures/ (no notebook runs). `make readme` rewrites the blocks (README.md is written only when a
# block changed, so a second run does nothing); `make test` runs tests/test_readme.py, which fails,
# naming the block, while README.md and figures/ disagree.
.PHONY: readme readme-check
readme: | $(STAMP) ## rewrite README.md's generated numbers from the committed figures/ (run it after `make all`)
	$(PY) -m fisherkron.experiments.readme README.md

readme-check: | $(STAMP) ## compare README.md's generated numbers with figures/ (what `make test` checks)
	$(PY) -m fisherkron.experiments.readme --check README.md
