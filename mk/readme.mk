# README.md is a front page; its two generated blocks (the paper's items with their computed
# verdicts, the recommended recipe's measurements) are rendered by fisherkron/repro/readme.py from
# the committed summary records in figures/ (no notebook runs). `make readme` rewrites them
# (README.md is written only when a block changed); `make test` runs tests/test_front_page.py,
# which fails while README.md and figures/ disagree.
.PHONY: readme readme-check
readme: | $(STAMP) ## rewrite README.md's generated blocks from the committed figures/ (run it after `make all`)
	$(PY) -m fisherkron.repro.readme README.md

readme-check: | $(STAMP) ## compare README.md's generated blocks with figures/ (what `make test` checks)
	$(PY) -m fisherkron.repro.readme --check README.md
