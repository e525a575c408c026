// A tool call waiting on a person: what would run, with what, and Approve/Deny. It is drawn from
// the session's `pendingApproval`, so when the call is decided anywhere (Slack, the terminal,
// another tab) the next poll clears it.
import type { PendingApproval } from "./api";
import { when } from "./time";

export function ApprovalCard(props: {
  approval: PendingApproval;
  me: string;
  deciding: boolean;
  onDecide: (approved: boolean) => void;
}) {
  const { approval } = props;
  return (
    <section className="approval" aria-label="Approval needed" data-approval-id={approval.approvalId}>
      <h2>Approval needed</h2>
      <p>
        The agent wants to run <code>{approval.toolName}</code> on <strong>{approval.server}</strong>{" "}
        with:
      </p>
      <pre>{approval.shown !== undefined ? approval.shown.join("\n") : JSON.stringify(approval.input, null, 2)}</pre>
      <p className="meta">
        Asked by {approval.requestedBy === props.me ? "you" : approval.requestedBy}; expires{" "}
        {when(approval.expiresAt)}.
      </p>
      <div className="decide">
        <button type="button" className="primary" disabled={props.deciding} onClick={() => props.onDecide(true)}>
          Approve
        </button>
        <button type="button" disabled={props.deciding} onClick={() => props.onDecide(false)}>
          Deny
        </button>
      </div>
    </section>
  );
}
