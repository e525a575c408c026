// A confirmation in a modal <dialog>: the browser traps focus in it and Escape cancels it.
import { type ReactNode, useEffect, useRef } from "react";

export type ConfirmRequest = {
  title: string;
  body: ReactNode;
  confirm: string;
  run: () => Promise<void> | void;
};

export function Confirm({ request, onClose }: { request: ConfirmRequest; onClose: () => void }) {
  const dialog = useRef<HTMLDialogElement>(null);
  useEffect(() => {
    const node = dialog.current;
    if (node !== null && !node.open) node.showModal();
    return () => node?.close();
  }, []);
  return (
    <dialog ref={dialog} className="confirm" aria-labelledby="confirm-title" onClose={onClose}>
      <h2 id="confirm-title">{request.title}</h2>
      {request.body}
      <form method="dialog" className="decide">
        <button type="submit" value="cancel" autoFocus>
          Cancel
        </button>
        <button
          type="button"
          className="primary"
          onClick={() => {
            onClose();
            void request.run();
          }}
        >
          {request.confirm}
        </button>
      </form>
    </dialog>
  );
}
