// One message as the page shows it: its text, its tool calls with their input and result, what
// the product said beside it, a checkpoint as such, the answer's usage and its trace.
import type { UIMessage } from "ai";
import type { MessageMetadata } from "./api";
import { when } from "./time";

export type Message = UIMessage<MessageMetadata>;
type Part = Message["parts"][number];

const number = new Intl.NumberFormat();
const dollars = new Intl.NumberFormat(undefined, {
  style: "currency",
  currency: "USD",
  maximumFractionDigits: 4,
});

export function usd(value: number): string {
  return dollars.format(value);
}

export function count(value: number): string {
  return number.format(value);
}

function json(value: unknown): string {
  if (typeof value === "string") return value;
  try {
    return JSON.stringify(value, null, 2) ?? "";
  } catch {
    return String(value);
  }
}

type RawUsage = Record<string, unknown>;

function numberOr(...values: unknown[]): number | null {
  for (const value of values) if (typeof value === "number" && Number.isFinite(value)) return value;
  return null;
}

/** An answer's usage as the API gives it (`inputTokens`…; the stored `input_tokens`… read too),
 * or null when it carries none. A cost the deployment cannot price (no price for the model) is
 * left out rather than shown as $0. */
export function usageOf(message: Message): { input: number; output: number; cost: number | null } | null {
  const raw = message.metadata?.usage as RawUsage | undefined;
  if (raw === undefined || raw === null || typeof raw !== "object") return null;
  const input = numberOr(raw.inputTokens, raw.input_tokens);
  const output = numberOr(raw.outputTokens, raw.output_tokens);
  if (input === null && output === null) return null;
  return { input: input ?? 0, output: output ?? 0, cost: numberOr(raw.costUsd, raw.cost_usd) };
}

export function textOf(message: Message): string {
  return message.parts
    .map((part) => (part.type === "text" ? part.text : ""))
    .join("")
    .trim();
}

export function MessageView(props: {
  message: Message;
  author: string | null;
  actions: React.ReactNode;
}) {
  const { message } = props;
  const meta = message.metadata ?? {};
  const usage = usageOf(message);
  if (meta.checkpoint) {
    return (
      <li className="message checkpoint" data-message-id={message.id} data-role="checkpoint">
        <div className="checkpoint-line" role="separator" aria-label="Checkpoint">
          Checkpoint: the conversation before this point is summarised
        </div>
        <details>
          <summary>Summary</summary>
          <div className="text">{textOf(message)}</div>
        </details>
        <div className="message-foot">{props.actions}</div>
      </li>
    );
  }
  return (
    <li className={`message ${message.role}`} data-message-id={message.id} data-role={message.role}>
      <div className="message-head">
        <span className="who">{message.role === "user" ? (props.author ?? "Someone") : "Agent"}</span>
        {meta.createdAt && <time dateTime={meta.createdAt}>{when(meta.createdAt)}</time>}
      </div>
      <div className="parts">
        {message.parts.map((part, index) => (
          <PartView key={index} part={part} />
        ))}
        {meta.interrupted && <p className="interrupted">(stopped before it finished)</p>}
      </div>
      <div className="message-foot">
        {usage !== null && (
          <span className="usage" aria-label="Usage of this answer">
            {count(usage.input)} in · {count(usage.output)} out
            {usage.cost !== null && ` · ${usd(usage.cost)}`}
          </span>
        )}
        {meta.traceUrl && (
          <a href={meta.traceUrl} target="_blank" rel="noreferrer">
            View trace
          </a>
        )}
        {props.actions}
      </div>
    </li>
  );
}

function PartView({ part }: { part: Part }) {
  if (part.type === "text") return <div className="text">{part.text}</div>;
  if (part.type === "reasoning") {
    return (
      <details className="reasoning">
        <summary>Reasoning</summary>
        <div className="text">{part.text}</div>
      </details>
    );
  }
  if (part.type === "dynamic-tool" || part.type.startsWith("tool-")) {
    const tool = part as Part & {
      toolName?: string;
      state: string;
      input?: unknown;
      output?: unknown;
      errorText?: string;
      approval?: { reason?: string };
    };
    const reason = tool.approval?.reason;
    const name = tool.toolName ?? part.type.slice("tool-".length);
    const state =
      tool.state === "output-available"
        ? "done"
        : tool.state === "output-error"
          ? "failed"
          : tool.state === "output-denied"
            ? "denied"
            : tool.state === "approval-requested"
              ? "waiting for approval"
              : "running";
    return (
      <details className={`tool ${state.replace(/ /g, "-")}`}>
        <summary>
          <span className="tool-name">{name}</span> <span className="tool-state">{state}</span>
        </summary>
        <div className="tool-body">
          <h4>Input</h4>
          <pre>{json(tool.input)}</pre>
          {tool.state === "output-available" && (
            <>
              <h4>Result</h4>
              <pre>{json(tool.output)}</pre>
            </>
          )}
          {tool.errorText !== undefined && (
            <>
              <h4>Error</h4>
              <pre>{tool.errorText}</pre>
            </>
          )}
          {typeof reason === "string" && reason !== "" && (
            <>
              <h4>Decision</h4>
              <p className="decision">{reason}</p>
            </>
          )}
        </div>
      </details>
    );
  }
  if (part.type.startsWith("data-")) {
    const data = (part as { data?: unknown }).data;
    const text =
      data !== null && typeof data === "object" && "text" in data ? String(data.text) : json(data);
    return <p className="notice">{text}</p>;
  }
  return null;
}
