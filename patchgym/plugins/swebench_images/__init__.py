"""SWE-bench instance images built without registries (`patchgym tasks build-images swebench`).

`recipe` translates a row's specs (from the `swebench` package) into scripts and pip steps,
`sources` reads local repository clones, `wheels` resolves and fetches the wheels on the host
and locks them, `bases` provides a Debian base with the row's Python, and `build` runs
`docker build --network none` and names the image as the harness names local ones.
"""
