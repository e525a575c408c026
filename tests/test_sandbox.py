"""The bashkit sandbox: isolation, limits, output cap, and what counts as a change."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from core.sandbox.shell import Sandbox, SandboxLimits


async def test_state_persists_between_runs() -> None:
    sandbox = Sandbox.new()
    await sandbox.run("mkdir -p /home/user/w && cd /home/user/w && echo one > a.txt")
    await sandbox.run("export COLOUR=green")
    result = await sandbox.run('pwd; cat a.txt; echo "$COLOUR"')
    assert result.exit_code == 0
    assert result.stdout == "/home/user/w\none\ngreen\n"
    assert not result.truncated


async def test_runaway_loop_is_stopped() -> None:
    sandbox = Sandbox.new(SandboxLimits(max_commands=1_000, max_loop_iterations=1_000))
    result = await sandbox.run("i=0; while true; do i=$((i+1)); done; echo unreachable")
    assert result.exit_code != 0
    assert "limit" in result.stderr
    assert "unreachable" not in result.stdout
    # The sandbox is still usable afterwards.
    assert (await sandbox.run("echo alive")).stdout == "alive\n"


async def test_loop_iterations_are_limited_even_with_few_commands() -> None:
    sandbox = Sandbox.new(SandboxLimits(max_commands=1_000_000, max_loop_iterations=100))
    result = await sandbox.run("for i in $(seq 1 1000); do :; done; echo unreachable")
    assert result.exit_code != 0
    assert "unreachable" not in result.stdout


async def test_wall_time_is_limited() -> None:
    sandbox = Sandbox.new(SandboxLimits(timeout_seconds=0.2))
    result = await sandbox.run("sleep 30; echo unreachable")
    assert result.exit_code != 0
    assert "timeout" in result.stderr
    assert "unreachable" not in result.stdout


async def test_host_filesystem_is_not_visible(tmp_path: Path) -> None:
    secret = tmp_path / "host-secret.txt"
    secret.write_text(f"secret {uuid.uuid4()}")
    sandbox = Sandbox.new()
    result = await sandbox.run(f"cat {secret}")
    assert result.exit_code != 0
    assert "secret" not in result.stdout
    listing = await sandbox.run(f"ls {tmp_path}; ls /")
    assert tmp_path.name not in listing.stdout.split()
    assert "work" not in listing.stdout.split()
    passwd = await sandbox.run("cat /etc/passwd")
    assert "root:x:0:0" not in passwd.stdout  # bashkit's virtual /etc, not the host's


async def test_network_is_off() -> None:
    sandbox = Sandbox.new()
    for command in ("curl -s https://example.com", "wget -q -O - https://example.com"):
        result = await sandbox.run(command)
        assert result.exit_code != 0
        assert "network access not configured" in result.stderr
        assert result.stdout == ""


async def test_no_embedded_interpreters() -> None:
    sandbox = Sandbox.new()
    assert (await sandbox.run("python3 -c 'print(1)'")).exit_code == 127


async def test_output_is_capped() -> None:
    sandbox = Sandbox.new(SandboxLimits(max_output_bytes=1_000))
    result = await sandbox.run("seq 1 50000")
    assert result.truncated
    assert result.exit_code == 0
    assert result.stdout.startswith("1\n2\n3\n")
    assert len(result.stdout.encode()) < 1_100
    assert "output truncated" in result.stdout


async def test_syntax_errors_are_results_not_exceptions() -> None:
    result = await Sandbox.new().run("if then fi (")
    assert result.exit_code != 0
    assert result.stderr


async def test_cancelled_run_leaves_the_sandbox_usable() -> None:
    sandbox = Sandbox.new(SandboxLimits(timeout_seconds=30))
    task = asyncio.create_task(sandbox.run("sleep 2; echo late > /tmp/late"))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    result = await sandbox.run("echo ok")
    assert result.stdout == "ok\n"


async def test_capture__nothing_when_no_command_ran() -> None:
    sandbox = Sandbox.new()
    assert not sandbox.dirty
    assert await sandbox.capture() is None


async def test_capture__nothing_for_commands_that_change_nothing() -> None:
    sandbox = Sandbox.new()
    await sandbox.run("echo hello; ls /; true")
    assert sandbox.dirty
    assert await sandbox.capture() is None
    assert not sandbox.dirty


@pytest.mark.parametrize(
    "command",
    ["echo data > /tmp/file", "mkdir -p /home/user/new", "cd /tmp", "export NAME=value"],
)
async def test_capture__files_directories_cwd_and_variables_are_changes(command: str) -> None:
    sandbox = Sandbox.new()
    await sandbox.run(command)
    captured = await sandbox.capture()
    assert captured is not None
    assert captured.commit in captured.base_set.members
    # Once captured, the same state is not a change any more.
    await sandbox.run("true")
    assert await sandbox.capture() is None


async def test_capture__a_small_edit_adds_few_small_objects() -> None:
    sandbox = Sandbox.new()
    sandbox.write_files({f"/home/user/p/f{i}.txt": f"line {i}\n" * 2_000 for i in range(20)})
    first = await sandbox.capture()
    assert first is not None
    await sandbox.run("sed -i '100s/$/ edited/' /home/user/p/f7.txt")
    second = await sandbox.capture()
    assert second is not None
    assert second.base_set == first.base_set  # the big set is reused
    assert second.delta_set is not None
    assert second.commit in second.delta_set.members
    assert len(second.objects) <= 6
    assert sum(len(o.data) for o in second.objects) < 2_000
    assert {o.codec for o in second.objects} <= {"zstd", "zstd-delta", "bashkit"}


async def test_nul_characters_in_output_are_replaced() -> None:
    """PostgreSQL's JSONB cannot store U+0000: a tool result holding one failed the turn."""
    result = await Sandbox.new().run("printf 'a\\0b'; head -c 64 /dev/zero")
    assert "\x00" not in result.stdout
    assert result.stdout.startswith("a\ufffdb")


async def test_a_background_job_past_the_time_limit_does_not_stall_later_commands() -> None:
    sandbox = Sandbox.new(SandboxLimits(timeout_seconds=0.5))
    await sandbox.run("echo kept > /tmp/k; export V=v; cd /tmp")
    stuck = await sandbox.run("sleep 1000 &")
    assert "timeout" in stuck.stderr
    assert "\nsandbox: the command ran into the time limit; the shell was restarted" in stuck.stderr
    result = await sandbox.run('echo alive; cat k; echo "$V"')
    assert (result.stdout, result.exit_code) == ("alive\nkept\nv\n", 0)


async def test_a_state_over_its_limit_is_reported_and_not_captured() -> None:
    sandbox = Sandbox.new(SandboxLimits(max_state_bytes=100_000))
    result = await sandbox.run("head -c 200000 /dev/zero > /tmp/big")
    assert result.exit_code != 0
    assert "over its limit of 100,000" in result.stderr
    assert sandbox.state_bytes() > 100_000
    assert await sandbox.capture() is None
    await sandbox.run("rm /tmp/big; echo small > /tmp/small")
    captured = await sandbox.capture()
    assert captured is not None
    assert captured.raw_size < 100_000
