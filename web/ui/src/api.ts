// The HTTP API (docs/http-api.md), the page's only way to the product: the shapes it answers
// with and one fetch helper that sends the CSRF token and turns a refusal into an ApiError.

export type Place = {
  kind: "slack" | "web" | "terminal";
  surface: "dm" | "channel" | "assistant" | null;
  url: string | null;
};

export type PendingApproval = {
  approvalId: string;
  toolCallId: string;
  toolName: string;
  server: string;
  input: unknown;
  /** Every argument as a person reads it: nothing cut, hidden or reordering characters escaped. */
  shown?: string[];
  requestedBy: string;
  expiresAt: string;
};

export type Session = {
  id: number;
  title: string;
  createdAt: string;
  updatedAt: string;
  place: Place;
  owner: { person: string; name: string };
  temporary: boolean;
  isActive: boolean;
  lastMessageId: string | null;
  pendingApproval: PendingApproval | null;
};

export type Me = {
  person: string;
  teamId: string;
  userId: string;
  name: string;
  admin: boolean;
  csrfToken: string | null;
  sessionPollSeconds: number;
  busyPollSeconds: number;
  traceUrlTemplate: string | null;
};

export type Usage = { inputTokens: number; outputTokens: number; costUsd: number };

export type MessageMetadata = {
  createdAt?: string;
  author?: string;
  checkpoint?: boolean;
  interrupted?: boolean;
  usage?: Usage;
  traceUrl?: string;
};

export type Page<T> = { data: T[]; nextCursor: string | null };

export type UsageRow = {
  key: string;
  inputTokens: number;
  outputTokens: number;
  costUsd: number | null;
  requests?: number;
  turns?: number;
};

export type Budget = {
  scope: "user" | "workspace" | "all";
  period: "day" | "month";
  limit: string;
  used: number;
  unit: "tokens" | "usd";
  resetsAt: string;
};

/** A refusal the API answered with (`{"code", "message", …}`), or a network failure. */
export class ApiError extends Error {
  readonly status: number;
  readonly code: string;
  readonly body: Record<string, unknown>;

  constructor(status: number, body: Record<string, unknown>) {
    const code = typeof body.code === "string" ? body.code : `http_${status}`;
    const message = typeof body.message === "string" ? body.message : `The server answered ${status}.`;
    super(message);
    this.status = status;
    this.code = code;
    this.body = body;
  }
}

let csrfToken: string | null = null;

/** Set once `/v1/me` has answered: every state-changing request carries it. */
export function setCsrfToken(token: string | null): void {
  csrfToken = token;
}

function changes(method: string): boolean {
  return !["GET", "HEAD", "OPTIONS"].includes(method.toUpperCase());
}

/** `fetch` for the API: same-origin cookie, CSRF header on changes, refusals thrown. */
export async function apiFetch(input: string, init: RequestInit = {}): Promise<Response> {
  const method = init.method ?? "GET";
  // A plain object, not a Headers: Chromium sends a Headers' names lower-cased and an object's
  // as written, and a server (or a proxy before it) that compares names exactly still matches.
  const headers: Record<string, string> = {};
  new Headers(init.headers).forEach((value, name) => {
    headers[name] = value;
  });
  if (changes(method) && csrfToken !== null) headers["X-CSRF-Token"] = csrfToken;
  if (init.body !== undefined && headers["content-type"] === undefined) {
    headers["Content-Type"] = "application/json";
  }
  const response = await fetch(input, { ...init, method, headers, credentials: "same-origin" });
  if (!response.ok) {
    let body: Record<string, unknown> = {};
    try {
      const parsed: unknown = await response.json();
      if (parsed !== null && typeof parsed === "object") body = parsed as Record<string, unknown>;
    } catch {
      // Not JSON (a proxy's page): the status alone says it.
    }
    // A sign-in that expired (or was signed out in another tab) mid-use: sign in again and
    // come back here. `/v1/me` itself answers 401 to show the sign-in screen.
    if (response.status === 401 && input !== "/v1/me") {
      window.location.assign(signInUrl(window.location.pathname + window.location.search));
    }
    throw new ApiError(response.status, body);
  }
  return response;
}

export async function getJson<T>(path: string): Promise<T> {
  return (await (await apiFetch(path)).json()) as T;
}

export async function sendJson<T>(path: string, method: string, body?: unknown): Promise<T> {
  const response = await apiFetch(path, {
    method,
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (response.status === 204) return undefined as T;
  return (await response.json()) as T;
}

/** Reads a UI message stream to its end (an approval's carried-out call and the rest of the
 * answer); the page then shows the persisted transcript. */
export async function drain(response: Response): Promise<void> {
  const reader = response.body?.getReader();
  if (reader === undefined) return;
  for (;;) {
    const { done } = await reader.read();
    if (done) return;
  }
}

export const sessionPath = (id: number | string): string => `/v1/agent_sessions/${id}`;

export function signInUrl(next: string): string {
  return `/auth/slack?next=${encodeURIComponent(next)}`;
}

export function describe(error: unknown): string {
  if (error instanceof ApiError) return error.message;
  if (error instanceof Error) return error.message;
  return String(error);
}
