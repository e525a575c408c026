// A tool call waiting on a person: what would run, with what, and Approve/Deny. It is drawn from
// the session's `pendingApproval`, so when the call is decided anywhere (Slack, the terminal,
// another tab) the next poll clears it. A reason is optional; it is kept with the decision and,
// on a denial, is what the model reads of why.
import { useState } from "react";
import type { PendingApproval } from "./api";
import { when } from "./time";

// The API keeps at most this many characters of a reason (a longer one is refused).
const REASON_MOST = 500;

export function ApprovalCard(props: {
  approval: PendingApproval;
  me: string;
  deciding: boolean;
  onDecide: (approved: boolean, reason: string) => void;
}) {
  const { approval } = props;
  const [reason, setReason] = useState("");
  const reasonId = `reason-${approval.approvalId}`;
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
      <div className="reason">
        <label htmlFor={reasonId}>Reason (optional)</label>
        <input
          id={reasonId}
          type="text"
          value={reason}
          maxLength={REASON_MOST}
          onChange={(e) => setReason(e.target.value)}
          disabled={props.deciding}
        />
      </div>
      <div className="decide">
        <button
          type="button"
          className="primary"
          disabled={props.deciding}
          onClick={() => props.onDecide(true, reason.trim())}
        >
          Approve
        </button>
        <button type="button" disabled={props.deciding} onClick={() => props.onDecide(false, reason.trim())}>
          Deny
        </button>
      </div>
    </section>
  );
}
