"""compile_check: a structured constraint compiled as the engine compiles it, in a child process, bounded in time."""

from dflash_train.compile_check import CompileCheck


def choice(strings: list[str]) -> dict:
    return {"structured": {"kind": "choice", "spec": strings}}


def test_a_compile_over_the_time_limit_is_the_requests_problem_and_the_next_one_still_compiles(tiny_target_dir):
    with CompileCheck(str(tiny_target_dir), seconds=1e-4) as check:
        check.problem(None)  # nothing to compile: no child yet
        assert check.proc is None
        slow = choice([f"label {i}" for i in range(5_000)])
        assert check.problem(slow) == ("its choice takes over 0.0001 s to compile (xgrammar, as vLLM compiles it "
                                       "for each request)")
        assert check.proc is None  # the compile was stopped with its child
        check.seconds = 60.0
        assert check.problem(choice(["yes", "no"])) is None
        assert check.problem(slow) == "its choice takes over 0.0001 s to compile (xgrammar, as vLLM compiles it " \
                                      "for each request)"  # the verdict is kept: never compiled twice
    assert check.proc is None
