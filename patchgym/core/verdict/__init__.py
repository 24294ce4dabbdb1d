"""The verdict channel: test outcomes the code under test cannot forge (see docs/security.md).

`session.supervised_run` runs a test command under the grader's supervisor
(`inside/supervisor.py`) with the grader's recorder (`inside/recorder.py`) loaded before any
repository code, adds canaries (`canaries`), and judges the records (`judge`).
"""
